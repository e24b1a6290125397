"""Requests the batch decoder does not take, generated alone by `recurrent_depth.inference`.

Self-speculative decoding (`draft_steps`) drafts and verifies several tokens per round, and
models with non-attention mixers keep recurrent states the KV pool does not hold; both are run
by the inference package's own `stream_generate`, one request per session. The engine advances
each such session by one token per iteration, between batched recurrence steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from recurrent_depth.inference import stream_generate
from recurrent_depth.inference.cache import make_cache
from recurrent_depth.inference.criteria import gate_for
from recurrent_depth.inference.engine import Recurrence
from recurrent_depth.inference.output import TokenEvent
from recurrent_depth.serving.batch import PromptScores, RowRequest, TokenResult, logprobs_of, prefill_prompt


class SoloRun:
    """One request as its own generation session, yielding `TokenResult`s one at a time."""

    def __init__(self, model: Any, request: RowRequest, generation_kwargs: dict[str, Any], tag: object = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.model = model
        self.request = request
        self.tag = tag
        kwargs = dict(generation_kwargs)
        kwargs["seed"] = request.seed
        kwargs["output_logits"] = request.top_logprobs is not None
        # should_stop reaches TTT-E2E's inner loop, which runs here, before `watch` can be called
        self.stream = stream_generate(model, torch.tensor([request.prompt]), should_stop=should_stop, **kwargs)
        self._events: Iterator[TokenEvent] = iter(self.stream)

    @torch.inference_mode()
    def prompt_scores(self) -> PromptScores:
        """Prompt log-probabilities from the session's prefill run again, read out at every position.

        It runs as the session's prefill does (`batch.prefill_prompt`, over the session's runner) and
        draws s_0 with a generator seeded like the session's (same seed, same shape, same order), so the
        scores are those of the session's own prefill (and of the same request in the batch): at the
        request's `num_steps`, or under `exit_in_prefill` at the step where the criterion stopped the
        prompt's positions together. A quantized cache calibrates on the same first writes as the
        session's (under exit_kv="compute" or `exit_in_prefill`, the criterion's readouts among them).
        """
        opts = self.request.options
        ids = torch.tensor([self.request.prompt], device=self.model.device)
        generator = torch.Generator(device=self.model.device).manual_seed(self.request.seed % (2**63))
        model = self.stream.model  # TTT-E2E: the adapted copy the session generates with
        quant = self.stream.session.options.quant
        cache = None
        if quant is not None:  # the session's prefill reads its prompt back from code rows: so must its scores
            cache = make_cache("static", 1, opts.deepest_step, capacity=ids.shape[1], policy=opts.policy,
                               core_layers=model.config.core_layers, kv_quant=quant)
        engine = Recurrence(model, runner=self.stream.session.engine.runner)  # without the session's hooks
        pass_ = engine.begin(ids, None, cache)
        state, _ = prefill_prompt(engine, pass_, opts, generator, gate_for(opts.criterion, model),
                                  model.config.vocab_size)
        logits = engine.readout(state, pass_)[0]
        if ids.shape[1] < 2:
            return PromptScores([None], [None])
        picked, tops = logprobs_of(logits[:-1], ids[0, 1:], self.request.top_logprobs or 0)
        return PromptScores([None, *picked], [None, *tops])

    def watch(self, should_stop: Callable[[], bool], on_step: Callable[[], None]) -> None:
        """Check `should_stop` between the session's core steps; call `on_step` after each."""
        engine = self.stream.session.engine
        engine.should_stop, engine.on_step = should_stop, on_step

    def next(self) -> TokenResult | None:
        """The next token, or None when the session has ended."""
        event = next(self._events, None)
        if event is None:
            return None
        result = TokenResult(event.token, event.steps, event.reason)
        if self.request.top_logprobs is not None:
            # The session keeps the logits that chose each token (output_logits=True).
            logits = self.stream.session.recorder.logits[0][event.index]
            picked, tops = logprobs_of(logits[None], torch.tensor([event.token]), self.request.top_logprobs)
            result.logprob, result.top = picked[0], tops[0]
        return result

    def close(self) -> None:
        """Stop the session early (the generator's cleanup restores the model's mode)."""
        close = getattr(self._events, "close", None)
        if close is not None:
            close()
