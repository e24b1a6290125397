"""The OpenAI JSON a request's answer is made of: each choice's state as the scheduler's events
arrive (`Choice`, `apply_event`), the whole response (`completion_body`, `chat_body`), the stream's
chunks (`completion_chunks`, `chat_chunks`), logprobs and usage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from recurrent_depth.serving.batch import PromptScores
from recurrent_depth.serving.engine import Done, Event, PromptEvent, TokenOut
from recurrent_depth.serving.protocol import ChatRequest, CompletionRequest, TokenizeRequest
from recurrent_depth.serving.text import IncrementalDecoder, TextCodec

NEGATIVE_INFINITY_LOGPROB = -9999.0  # what JSON (no -Infinity) shows for a token of probability 0


def finite_logprob(value: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (probability 0) -> -9999.0, NaN / +inf (a broken
    model) -> null, rather than invalid JSON or a 500."""
    if value is None or math.isfinite(value):
        return value
    return NEGATIVE_INFINITY_LOGPROB if value < 0 else None


def finite_top(top: list[tuple[int, float]] | None) -> list[tuple[int, float | None]] | None:
    return None if top is None else [(i, finite_logprob(v)) for i, v in top]


@dataclass
class Choice:
    """What one job has produced so far (assembled into the response)."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_scores: PromptScores | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or request stop token id that ended it
    completion_tokens: int = 0
    core_steps: int = 0
    ttt_flops: float | None = None  # TTT-E2E's inner forward + backward FLOPs (None: no TTT-E2E)
    offsets: IncrementalDecoder | None = None  # a stream's text offsets so far (`last_token_logprobs`)
    offset: int = 0  # the length of the text `offsets` has decoded


def apply_event(event: Event, choices: list[Choice]) -> Choice:
    """Add a scheduler event to the choice it belongs to; that choice."""
    choice = choices[event.index]
    if isinstance(event, PromptEvent):
        choice.prompt_scores = PromptScores([finite_logprob(v) for v in event.scores.logprobs],
                                            [finite_top(t) for t in event.scores.top])
    elif isinstance(event, TokenOut):
        choice.text += event.text
        choice.tokens.append(event.token)
        choice.steps.append(event.steps)
        choice.reasons.append(event.reason)
        choice.logprobs.append(finite_logprob(event.logprob))
        choice.tops.append(finite_top(event.top))
    elif isinstance(event, Done):
        choice.text += event.text
        choice.finish_reason = event.finish_reason
        choice.stop_reason = event.stop_reason
        choice.completion_tokens = event.completion_tokens
        choice.core_steps = event.core_steps
        choice.ttt_flops = event.ttt_flops
    return choice


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(c.completion_tokens for c in choices)
    steps = sum(c.core_steps for c in choices)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion, "completion_steps": steps,
           "steps_per_token": round(steps / completion, 4) if completion else 0.0}
    ttt = [c.ttt_flops for c in choices if c.ttt_flops is not None]
    if ttt:  # TTT-E2E requests: the test-time training's model FLOPs (train.flops' counter), all choices
        out["ttt_flops"] = float(sum(ttt))
    return out


def _with_steps(item: dict[str, Any], steps: list[int] | None, return_steps: bool) -> dict[str, Any]:
    """`item` with the per-token depths when the request asked for them (`return_steps`)."""
    if steps is not None and return_steps:
        item["steps"] = steps
    return item


# ------------------------------------------------------------------ completions
def legacy_top(codec: TextCodec, token: int, logprob: float | None,
               top: list[tuple[int, float | None]] | None) -> dict[str, float | None] | None:
    """One position's legacy `top_logprobs`: the N most likely tokens, plus the token chosen there (sampled, or the
    prompt's) when it is not among them, so up to N + 1 entries as OpenAI's API and vLLM give: a sampled token
    outside the top N, and every token with `logprobs: 0`, had no entry. None where the position has no scores
    (the first prompt token)."""
    if top is None:
        return None
    out = {codec.token_string(i): lp for i, lp in top}
    out.setdefault(codec.token_string(token), logprob)
    return out


def echoed_prompt(codec: TextCodec, req: CompletionRequest, choice: Choice) -> str:
    """The prompt text `echo` returns, as OpenAI and vLLM return it: a string prompt as it was sent, a token-id
    prompt decoded with its special tokens (vLLM's `tokenizer.decode`). Decoding either with special tokens
    skipped dropped a ChatML prompt's `<|im_start|>` and `<|im_end|>`, so `text[len(prompt):]` cut the answer."""
    prompt = req.prompts[choice.index // req.sampling.n]
    return prompt if isinstance(prompt, str) else codec.decode(choice.prompt_ids, skip_special_tokens=False)


def echo_offsets(codec: TextCodec, prompt_ids: list[int], echoed: str | None = None) -> tuple[list[int], int]:
    """The text offsets of an echoed prompt's tokens, special tokens counted by their text as in
    `echoed_prompt`, and where the completion's text starts: in `echoed`, the text echo returns (None: what the
    prompt decodes to). A string prompt is echoed as sent, without the BOS the tokenizer added: counting the BOS's
    text (`<|begin_text|>`) put every offset after it, the completion's too, that many characters too far."""
    decoder = IncrementalDecoder(codec, skip_special_tokens=False)
    offsets, length = [], 0
    for t in prompt_ids:
        offsets.append(length)
        length += len(decoder.push(t))
    decoded = len(codec.decode(prompt_ids, skip_special_tokens=False))
    if echoed is None:
        return offsets, decoded
    shift = decoded - len(echoed)  # the text the decoded prompt has in front of the echoed one (its BOS)
    return [min(max(o - shift, 0), len(echoed)) for o in offsets], len(echoed)


def completion_logprobs(codec: TextCodec, choice: Choice, echo: bool, first: int = 0,
                        skip_special_tokens: bool = True, echoed: str | None = None) -> dict[str, Any]:
    """OpenAI legacy logprobs for tokens [first:] of (echoed prompt +) completion; the completion's text offsets
    count special tokens as its text does (`skip_special_tokens`), from the start of the returned text (`echoed`:
    the echoed prompt's, `echo_offsets`)."""
    ids, lps, tops, offsets, length = [], [], [], [], 0
    if echo:
        scores = choice.prompt_scores
        ids += choice.prompt_ids
        lps += scores.logprobs if scores else [None] * len(choice.prompt_ids)
        tops += scores.top if scores else [None] * len(choice.prompt_ids)
        offsets, length = echo_offsets(codec, choice.prompt_ids, echoed)
    ids += choice.tokens
    lps += choice.logprobs
    tops += choice.tops
    # the completion's text continues its prompt
    decoder = IncrementalDecoder(codec, continuation=True, skip_special_tokens=skip_special_tokens)
    for t in choice.tokens:  # offsets into the returned text (echoed prompt + completion)
        offsets.append(length)
        length += len(decoder.push(t))
    return {
        "tokens": [codec.token_string(t) for t in ids[first:]],
        "token_logprobs": lps[first:],
        "top_logprobs": [legacy_top(codec, t, lp, top) for t, lp, top in zip(ids[first:], lps[first:], tops[first:])],
        "text_offset": offsets[first:],
    }


def last_token_logprobs(codec: TextCodec, choice: Choice, echo: bool, skip_special_tokens: bool = True,
                        echoed: str | None = None) -> dict[str, Any]:
    """`completion_logprobs(codec, choice, echo)` of the choice's newest token alone, for a stream: the
    decoder measuring text offsets is kept on the choice (decoding every earlier token again for each
    new one made a 2000-token stream cost 12 s of the event loop's time)."""
    if choice.offsets is None:
        choice.offsets = IncrementalDecoder(codec, continuation=True, skip_special_tokens=skip_special_tokens)
        choice.offset = echo_offsets(codec, choice.prompt_ids, echoed)[1] if echo else 0
        for t in choice.tokens[:-1]:
            choice.offset += len(choice.offsets.push(t))
    token, top = choice.tokens[-1], choice.tops[-1]
    offset = choice.offset
    choice.offset += len(choice.offsets.push(token))
    return {"tokens": [codec.token_string(token)], "token_logprobs": [choice.logprobs[-1]],
            "top_logprobs": [legacy_top(codec, token, choice.logprobs[-1], top)],
            "text_offset": [offset]}


def completion_body(codec: TextCodec, req: CompletionRequest, head: dict[str, Any], choices: list[Choice],
                    prompts: list[list[int]]) -> dict[str, Any]:
    """The whole (non-streamed) answer of a completions request."""
    body_choices = []
    for c in choices:
        text = (echoed_prompt(codec, req, c) if req.echo else "") + c.text
        item: dict[str, Any] = {
            "index": c.index, "text": text,
            "logprobs": completion_logprobs(codec, c, req.echo, skip_special_tokens=req.sampling.skip_special_tokens,
                                            echoed=echoed_prompt(codec, req, c) if req.echo else None)
            if req.logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        }
        body_choices.append(_with_steps(item, c.steps, req.sampling.return_steps))
    return {**head, "choices": body_choices, "usage": usage(choices, prompts)}


def completion_chunks(codec: TextCodec, event: Event, choice: Choice, req: CompletionRequest,
                      head: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream chunks one event of a completions request makes."""
    out = []

    def chunk(text: str, finish: str | None, logprobs: dict | None, steps: list[int] | None = None,
              **ending: Any) -> None:
        item: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                **ending}
        out.append({**head, "choices": [_with_steps(item, steps, req.sampling.return_steps)]})

    if isinstance(event, PromptEvent) and req.echo:
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(codec, choice, echo=True, skip_special_tokens=req.sampling.skip_special_tokens,
                                     echoed=echoed_prompt(codec, req, choice))
        chunk(echoed_prompt(codec, req, choice), None, lp)
    elif isinstance(event, TokenOut):
        lp = None
        if req.logprobs is not None:
            # text_offset counts from the start of the returned text, the echoed prompt included
            # (the echoed text is read once, by the choice's first token: a token-id prompt is decoded for it)
            echoed = echoed_prompt(codec, req, choice) if req.echo and choice.offsets is None else None
            lp = last_token_logprobs(codec, choice, req.echo, req.sampling.skip_special_tokens, echoed)
        chunk(event.text, None, lp, [event.steps])
    elif isinstance(event, Done):  # (the choice's last chunk)
        # it carries no token: with logprobs asked for, vLLM sends the object with empty lists there, not null
        lp = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")} \
            if req.logprobs is not None else None
        chunk(event.text, event.finish_reason, lp, stop_reason=event.stop_reason)
    return out


# ------------------------------------------------------------------ chat
def chat_logprobs(codec: TextCodec, choice: Choice, first: int = 0) -> dict[str, Any]:
    content = []
    for t, lp, top in zip(choice.tokens[first:], choice.logprobs[first:], choice.tops[first:]):
        content.append({
            "token": codec.token_string(t), "logprob": lp, "bytes": list(codec.token_bytes(t)),
            "top_logprobs": [{"token": codec.token_string(i), "logprob": v, "bytes": list(codec.token_bytes(i))}
                             for i, v in (top or [])],
        })
    return {"content": content, "refusal": None}


def chat_body(codec: TextCodec, req: ChatRequest, head: dict[str, Any], choices: list[Choice],
              prompt: list[int]) -> dict[str, Any]:
    """The whole (non-streamed) answer of a chat request."""
    body_choices = []
    for c in choices:
        item: dict[str, Any] = {
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(codec, c) if req.logprobs else None, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        body_choices.append(_with_steps(item, c.steps, req.sampling.return_steps))
    return {**head, "object": "chat.completion", "choices": body_choices, "usage": usage(choices, [prompt])}


def chat_chunks(codec: TextCodec, event: Event, choice: Choice, req: ChatRequest,
                head: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream chunks one event of a chat request makes."""
    if isinstance(event, TokenOut):
        item: dict[str, Any] = {"index": choice.index, "delta": {"content": event.text},
                                "logprobs": chat_logprobs(codec, choice, len(choice.tokens) - 1) if req.logprobs
                                else None, "finish_reason": None}
        return [{**head, "choices": [_with_steps(item, [event.steps], req.sampling.return_steps)]}]
    if isinstance(event, Done):
        out = []
        if event.text:
            out.append({**head, "choices": [{"index": choice.index, "delta": {"content": event.text},
                                             "logprobs": None, "finish_reason": None}]})
        out.append({**head, "choices": [{"index": choice.index, "delta": {}, "logprobs": None,
                                         "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}]})
        return out
    return []


def tokenize_body(req: TokenizeRequest, ids: list[int], max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenize answer: the ids, their count, the context; the pieces when `return_token_strs`."""
    body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = req.token_strs
    return body
