"""The serving pieces without HTTP: the continuous batch equals `generate` alone for every row,
whatever joins and leaves around it; prompt scores equal a full forward; text and stop strings;
request validation; the engine's solo path for models the batch does not take.

Tolerance: log-probabilities of one computation at different batch shapes differ by float32
rounding only (observed <= 1e-6); we allow 1e-4. Tokens, steps and exit reasons match exactly.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.inference import generate
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, RowRequest
from recurrent_depth.serving.engine import Done, Engine, Job, TokenOut
from recurrent_depth.serving.protocol import APIError, Limits, parse_chat, parse_completion
from recurrent_depth.serving.text import IncrementalDecoder, TextCodec, TextState
from tests.batch_support import serve_in_one_batch

TOL = 1e-4


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


MODES = {
    "fixed-6": dict(num_steps=6),
    "fixed-3": dict(num_steps=3),
    "zero-steps": dict(num_steps=0),
    "kl": dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-2),
    "entropy-min-max": dict(num_steps=6, exit_criterion="entropy-diff", min_steps=2, max_steps=9),
    "latent": dict(num_steps=5, exit_criterion="latent-diff", exit_threshold=0.1),
    "argmax": dict(num_steps=7, exit_criterion="argmax-stability", exit_threshold=2, repetition_penalty=1.5),
    "budget-2-kl": dict(num_steps=6, kv_budget=2, exit_criterion="kl", exit_threshold=1e-2),
    "budget-4": dict(num_steps=6, kv_budget=4),
    "warm-cosine": dict(num_steps=6, warm_start=True, exit_criterion="cosine", exit_threshold=5e-3),
    "sampled-random-s0": dict(num_steps=4, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, init_scale=1.0),
    "sampled-kl": dict(num_steps=5, do_sample=True, min_p=0.01, exit_criterion="kl", exit_threshold=1e-2),
}


def run_schedule(model, jobs, joins_per_iteration: int, max_rows: int):
    """Feed jobs (prompt, options kwargs, seed) to a BatchDecoder, `joins_per_iteration` at a time,
    removing each row when it has its tokens. Returns each job's TokenResults and the decoder."""
    dec = BatchDecoder(model, max_rows=max_rows)
    pending = list(range(len(jobs)))
    out: dict[int, list] = {}
    while pending or len(dec):
        for _ in range(joins_per_iteration):
            if pending and len(dec) < max_rows:
                j = pending.pop(0)
                prompt, kw, seed = jobs[j]
                opts = GenerationOptions(**kw).validate(model.config.mean_recurrence)
                seq, first, _ = dec.add(RowRequest(prompt, opts, seed, top_logprobs=3), tag=j)
                out[j] = [first]
                if len(out[j]) >= kw["max_new_tokens"]:
                    dec.remove(seq)
        for seq, result in dec.step():
            out[seq.tag].append(result)
            if len(out[seq.tag]) >= jobs[seq.tag][1]["max_new_tokens"]:
                dec.remove(seq)
    return out, dec


@pytest.mark.parametrize("joins,max_rows", [(1, 4), (3, 8), (12, 12)],
                         ids=["trickle-4rows", "bursts-8rows", "all-at-once"])
def test_continuous_batch_equals_each_request_alone(model, joins, max_rows):
    g = torch.Generator().manual_seed(7)
    jobs = []
    for j, mode in enumerate(MODES.values()):
        prompt = torch.randint(0, 256, (3 + (5 * j) % 11,), generator=g).tolist()
        kw = dict(max_new_tokens=3 + (7 * j) % 8, init_scale=0.0)
        kw.update(mode)
        jobs.append((prompt, kw, 100 + j))
    out, dec = run_schedule(model, jobs, joins, max_rows)
    assert dec.core_rows / dec.iterations > 2  # rows really shared core steps
    for j, (prompt, kw, seed) in enumerate(jobs):
        alone = generate(model, torch.tensor(prompt), seed=seed, output_logits=True, **kw)
        tokens = alone.token_lists()[0]
        mine = out[j]
        name = list(MODES)[j]
        assert [r.token for r in mine] == tokens, name
        assert [r.steps for r in mine] == alone.steps[0, : len(tokens)].tolist(), name
        assert [r.reason for r in mine] == alone.exit_reasons[0], name
        logp = torch.log_softmax(alone.logits[0], -1)
        want = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r.logprob for r in mine]), want, rtol=0, atol=TOL)
        top = logp.topk(3, dim=-1)
        for r, ids, values in zip(mine, top.indices.tolist(), top.values):
            torch.testing.assert_close(torch.tensor([v for _, v in r.top]), values, rtol=0, atol=TOL)
            assert [i for i, _ in r.top] == ids


@pytest.mark.parametrize("kv_quant,layout", [(None, "sandwich"), ("k=prod:3.5,v=mse:3.5", "sandwich"),
                                             (None, "pre-norm")], ids=["fused", "fused-kv-quant", "reference"])
def test_a_windowed_model_batches_and_each_row_windows_from_its_own_column(kv_quant, layout):
    """Per-layer sliding windows (`attention_windows`) in the batch: rows of different lengths, prompts longer
    than the windows, exit criteria, a KV budget and a skip lookup; each row equals generate alone, through the
    fused runner (Huginn's layout) and the model's own modules (a retrofit's pre-norm). The window of a row shorter
    than the longest ended at the longest row's column (logits off by ~0.1) before rows had their own."""
    torch.manual_seed(5)
    cfg = rd.ModelConfig.from_preset("tiny", attention_windows=[3, None, 2, 4], block_layout=layout)
    model = rd.RecurrentDepthLM(cfg).eval()
    assert BatchDecoder.supports(model)
    g = torch.Generator().manual_seed(11)
    modes = [dict(num_steps=3), dict(num_steps=4, exit_criterion="kl", exit_threshold=1e-2),
             dict(num_steps=4, kv_budget=2),
             dict(num_steps=5, kv_policy="per-step+skip", exit_criterion="kl", exit_threshold=5e-2)]
    jobs = [(torch.randint(0, 256, (n,), generator=g).tolist(), dict(max_new_tokens=m, init_scale=0.0, **mode), j)
            for j, (n, m, mode) in enumerate(zip((9, 4, 13, 6), (6, 7, 4, 5), modes))]
    out = serve_in_one_batch(model, [(prompt, kw) for prompt, kw, _ in jobs], kv_quant=kv_quant, seed_by_job=True,
                             top_logprobs=0)
    for prompt, kw, j in jobs:
        alone = generate(model, torch.tensor(prompt), seed=j, output_logits=True, kv_quant=kv_quant, **kw)
        tokens = alone.token_lists()[0]
        assert [r.token for r in out[j]] == tokens, j
        want = torch.log_softmax(alone.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]), want, rtol=0, atol=TOL)


def test_rows_exit_at_their_own_depth_and_start_their_next_token_at_once(model):
    """An adaptive row finishes tokens while a deep fixed-depth row is still recurring: it does
    not wait for the deepest row of the batch."""
    opts_fixed = GenerationOptions(max_new_tokens=4, num_steps=12, init_scale=0.0).validate(4)
    opts_exit = GenerationOptions(max_new_tokens=12, num_steps=12, exit_criterion="kl", exit_threshold=0.5,
                                  init_scale=0.0).validate(4)
    dec = BatchDecoder(model, 4)
    fixed, _, _ = dec.add(RowRequest([1, 2, 3], opts_fixed, 0))
    adaptive, _, _ = dec.add(RowRequest([4, 5, 6, 7], opts_exit, 0))
    finished = {id(fixed): [], id(adaptive): []}
    for _ in range(12):  # one token of the fixed row
        for seq, result in dec.step():
            finished[id(seq)].append(result.steps)
    assert finished[id(fixed)] == [12]
    assert len(finished[id(adaptive)]) >= 2 and all(s < 12 for s in finished[id(adaptive)])
    assert dec.core_rows == 2 * dec.iterations  # both rows recurred in every iteration


def test_fixed_depth_rows_recur_in_lockstep(model):
    """A fixed-depth row that joins mid-token waits for its cohort's next token boundary."""
    opts = GenerationOptions(max_new_tokens=8, num_steps=5, init_scale=0.0).validate(4)
    dec = BatchDecoder(model, 4)
    dec.add(RowRequest([1, 2, 3], opts, 0))
    dec.step()
    dec.step()
    dec.add(RowRequest([4, 5], opts, 0))  # joins at step 2 of the first row's token
    sizes = []
    for _ in range(13):
        before = dec.core_rows
        finished = dec.step()
        sizes.append((dec.core_rows - before, len(finished)))
    assert sizes[:3] == [(1, 0), (1, 0), (1, 1)]  # the first row finishes its token alone
    assert sizes[3:8] == [(2, 0)] * 4 + [(2, 2)]  # then both recur together, one call per step


def test_prompt_scores_equal_a_full_forward_and_zero_new_tokens_keeps_no_row(model):
    prompt = [5, 17, 99, 3, 250, 42, 8]
    opts = GenerationOptions(max_new_tokens=0, num_steps=5, init_scale=0.0).validate(4)
    dec = BatchDecoder(model, 2)
    seq, first, scores = dec.add(RowRequest(prompt, opts, 0, top_logprobs=2, prompt_logprobs=True))
    assert seq is None and first is None and len(dec) == 0
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]), num_steps=5, init_scale=0.0).logits[0], -1)
    want = logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert scores.logprobs[0] is None and scores.top[0] is None
    torch.testing.assert_close(torch.tensor(scores.logprobs[1:]), want, rtol=0, atol=TOL)
    assert [t[0][0] for t in scores.top[1:]] == logp[:-1].argmax(-1).tolist()


@pytest.mark.parametrize("new_tokens", [2, 0])
def test_solo_prompt_scores_under_exit_in_prefill_are_read_at_the_prefills_exit_step(model, new_tokens):
    """`echo` + `logprobs` of a request whose prompt runs under its exit criterion (`exit_in_prefill`, the
    official profile's default with a criterion) scored the prompt at the full `num_steps`, while the
    session's prefill stopped every prompt position at the criterion's step."""
    from recurrent_depth.serving.solo import SoloRun

    prompt, seed = [5, 17, 99, 3, 250, 42, 8], 11
    kwargs = dict(num_steps=8, exit_criterion="kl", exit_threshold=1e9, exit_in_prefill=True, max_new_tokens=2)
    options = GenerationOptions(**kwargs).validate(4)
    solo = SoloRun(model, RowRequest(prompt, options, seed, top_logprobs=0, prompt_logprobs=True),
                   dict(kwargs, max_new_tokens=new_tokens))
    scores = torch.tensor(solo.prompt_scores().logprobs[1:])
    probe = SoloRun(model, RowRequest(prompt, options, seed, top_logprobs=0), dict(kwargs, output_logits=True))
    first = probe.next()
    depth, chose_first = first.steps, probe.stream.session.recorder.logits[0][0]
    assert 1 <= depth < 8

    def forward(steps: int) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([prompt]), num_steps=steps, generator=torch.Generator().manual_seed(seed))
        return torch.log_softmax(out.logits[0], -1)

    at_exit, at_full = forward(depth), forward(8)
    torch.testing.assert_close(at_exit[-1], torch.log_softmax(chose_first, -1), rtol=0, atol=TOL)  # same prefill
    picked = lambda logp: logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]  # noqa: E731
    torch.testing.assert_close(scores, picked(at_exit), rtol=0, atol=TOL)
    assert (scores - picked(at_full)).abs().max() > 10 * TOL
    if new_tokens:  # the first token, taken early to learn the depth, is still delivered first
        assert solo.next().token == first.token
    solo.close()
    probe.close()


# ---------------------------------------------------------------------------------------- text
@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(["héllo wörld 🙂 def add(a, b): return a + b\n"] * 8, 300), out)
    return TextCodec(out, 300)


def test_incremental_decoding_equals_decoding_everything(codec):
    ids = codec.encode("héllo 🙂 wörld, def add", add_special_tokens=True)
    dec = IncrementalDecoder(codec)
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == codec.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # split UTF-8 sequences are held back, never emitted broken


@pytest.mark.parametrize("stop,text,emitted", [
    (["b):"], "def add(a, b): return", "def add(a, "),
    (["🙂"], "héllo 🙂 wörld", "héllo "),
    (["zz"], "héllo wörld", "héllo wörld"),
    (["ld", "wö"], "héllo wörld", "héllo "),
], ids=["ascii-across-tokens", "emoji", "no-hit", "earliest-of-two"])
def test_stop_strings_cut_the_text_before_the_stop(codec, stop, text, emitted):
    state = TextState(codec, stop)
    shown, hit = "", False
    for t in codec.encode(text, add_special_tokens=False):
        piece, hit = state.push(t)
        shown += piece
        if hit:
            break
    if not hit:
        shown += state.flush()
    assert shown == emitted and hit == (emitted != text)


def test_token_strings_are_distinct_for_partial_utf8(codec):
    ids = codec.encode("🙂", add_special_tokens=False)
    strings = [codec.token_string(t) for t in ids]
    assert b"".join(codec.token_bytes(t) for t in ids) == "🙂".encode()
    assert len(set(strings)) == len(ids)


@pytest.mark.parametrize("decoder", ["replace", "metaspace"])
def test_sentencepiece_tokens_show_their_text_in_logprobs(tmp_path, decoder):
    """A Gemma- or Llama-style tokenizer (pieces "\u2581the", byte fallback "<0xF0>") showed its logprobs tokens as
    the raw pieces: "\u2581the" for " the", the bytes of the text "<0xF0>" for byte F0, so a client joining `bytes`
    got another text; the bound on a text's tokens still reads the pieces as the normalizer writes them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pieces = ["<unk>", "\u2581", "t", "h", "e", "\u2581t", "\u2581th", "\u2581the", "\u2581\u2581", "\u2581" * 4]
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("\u2581", "\u2581"),
              ("\u2581\u2581", "\u2581\u2581")]
    vocab = {p: i for i, p in enumerate(pieces + [f"<0x{b:02X}>" for b in range(256)])}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    if decoder == "replace":  # Gemma's
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:  # Llama's and Mistral's older ones
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="never")])
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path, 300)
    ids = codec.encode(" the 🙂", add_special_tokens=False) + [tok.token_to_id("<eos>")]
    assert [codec.token_string(t) for t in ids] == [" the", " ", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x99",
                                                    "bytes:\\x82", "<eos>"]
    assert b"".join(codec.token_bytes(t) for t in ids[:-1]) == " the 🙂".encode()
    assert codec.longest_token_bytes == 12  # "\u2581\u2581\u2581\u2581": the normalized text's bytes per token


def test_a_completion_keeps_its_first_tokens_leading_space_under_a_stripping_decoder(tmp_path):
    """Llama's and Mistral's decoders strip a text's leading space (`Strip`, `Metaspace`): the server decoded a
    completion on its own, so "a" + " the a" came back as "athe a" (and stop strings and offsets followed)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from recurrent_depth.serving.responses import Choice, completion_logprobs

    pieces = ["<unk>", "\u2581", "t", "h", "e", "\u2581t", "\u2581th", "\u2581the", "a", "\u2581a"]
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("\u2581", "a")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path, 10)
    prompt, completion = tok.encode("a").ids, [7, 9]  # "a", then " the", " a"
    assert tok.decode(prompt + completion) == "a the a"
    state = TextState(codec, [" a"])
    assert [state.push(t) for t in completion] == [(" th", False), ("e", True)]  # (" a" may start at "e")
    choice = Choice(0, prompt, text=" the a", tokens=completion, logprobs=[0.0, 0.0], tops=[None, None])
    assert completion_logprobs(codec, choice, echo=False)["text_offset"] == [0, 4]
    assert completion_logprobs(codec, choice, echo=True)["text_offset"] == [0, 1, 5]  # "a" + " the" + " a"


# ---------------------------------------------------------------------------------------- validation
LIMITS = Limits(max_seq_len=256, mean_recurrence=4, vocab_size=300, max_num_steps=64)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "num_steps": 65}, "num_steps"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "kv_budget": "2"}, "kv_budget"),
    ({"prompt": "x", "exit_criterion": "kl", "exit_threshold": "low"}, "exit_threshold"),
    ({"prompt": "x", "logit_bias": {"1": 1}}, "logit_bias"),
    ({"prompt": [1, 2, 300]}, "prompt"),
], ids=["depth-over-server-limit", "bool-is-not-int", "string-budget", "string-threshold", "logit-bias", "vocab"])
def test_validation_names_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_completion(body, LIMITS, {"m"})
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "num_steps": 4, "draft_steps": 2}, "draft_steps", "temperature"),  # default temperature 1
    ({"prompt": "x", "num_steps": 0, "exit_criterion": "kl"}, "num_steps", "num_steps"),
], ids=["draft-with-sampling", "exit-at-depth-zero"])
def test_option_conflicts_name_the_field_the_client_sent(body, param, words):
    """Conflicts found by `GenerationOptions.validate` used to come back with param null (or naming
    min_steps, which the client never sent) and spoke of do_sample, which is not a wire field."""
    with pytest.raises(APIError) as info:
        parse_completion(body, LIMITS, {"m"}).sampling.options(2, 4, LIMITS)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert words in info.value.message and "do_sample" not in info.value.message


@pytest.mark.parametrize("fields,want", [
    ({"max_completion_tokens": None, "max_tokens": 5}, 5),
    ({"max_completion_tokens": 7, "max_tokens": 5}, 7),
    ({"max_tokens": None}, None),
], ids=["null-new-name-falls-back", "new-name-wins", "both-unset"])
def test_chat_max_tokens_null_means_unset(fields, want):
    """An explicit null max_completion_tokens used to hide max_tokens (the answer ran to the context's end)."""
    chat = parse_chat({"messages": [{"role": "user", "content": "a"}], **fields}, LIMITS, {"m"})
    assert chat.sampling.max_tokens == want


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_answer_past_the_context_names_the_length_field_the_client_sent(field):
    """A chat request's max_completion_tokens past the context was refused naming max_tokens (message and param),
    a field the client never sent."""
    chat = parse_chat({"messages": [{"role": "user", "content": "a"}], field: 60}, LIMITS, {"m"})
    with pytest.raises(APIError) as info:
        chat.sampling.options(LIMITS.max_seq_len - 10, 60, LIMITS)
    assert info.value.param == field and f"{field} is 60" in info.value.message
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:  # a prompt that fills the context: the messages, not chat's absent 'prompt'
        chat.sampling.options(LIMITS.max_seq_len, 60, LIMITS)
    assert info.value.param == "messages"


def test_validation_accepts_the_documented_extra_fields():
    req = parse_completion({"prompt": [[1, 2], [3]], "n": 2, "num_steps": 8, "exit_criterion": "kl",
                            "exit_threshold": 1e-3, "kv_budget": 4, "warm_start": True, "top_k": -1,
                            "user": "u", "stream": True, "stream_options": {"include_usage": True}}, LIMITS, {"m"})
    assert len(req.prompts) == 2 and req.sampling.n == 2
    opts = req.sampling.options(2, 16, LIMITS)
    assert (opts.num_steps, opts.exit_criterion, opts.kv_budget, opts.warm_start, opts.top_k) == (8, "kl", 4, True,
                                                                                                  None)
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}]},
                      LIMITS, {"m"})
    assert chat.messages == [{"role": "user", "content": "a\nb"}]  # text parts joined as vLLM / llama.cpp join them
    with pytest.raises(APIError) as info:
        req.sampling.options(250, 16, LIMITS)
    assert info.value.code == "context_length_exceeded"


# ---------------------------------------------------------------------------------------- engine solo path
def test_engine_serves_models_the_batch_does_not_take_through_generate(tmp_path):
    """A model with a linear-attention core runs each request as its own generate session."""
    torch.manual_seed(3)
    cfg = rd.ModelConfig.from_preset("tiny", mixer={"prelude": "attention", "core": "linear_attention",
                                                    "coda": "attention"})
    model = rd.RecurrentDepthLM(cfg).eval()
    assert not BatchDecoder.supports(model)
    engine = Engine(model, max_batch=4)
    engine.start()
    try:
        codec = TextCodec(None, cfg.vocab_size)
        prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
        events: dict[int, list] = {0: [], 1: []}
        done = threading.Event()

        def sink(event):
            events[event.index].append(event)
            if sum(isinstance(e, Done) for es in events.values() for e in es) == len(prompts):
                done.set()

        opts = GenerationOptions(max_new_tokens=5, num_steps=3, init_scale=0.0).validate(4)
        jobs = [Job(RowRequest(p, opts, 0), 5, frozenset(), TextState(codec, []), sink, time.monotonic() + 60,
                    index=i, generation_kwargs=dict(num_steps=3, init_scale=0.0, max_new_tokens=5))
                for i, p in enumerate(prompts)]
        engine.submit(jobs)
        assert done.wait(60)
    finally:
        engine.stop()
    for i, p in enumerate(prompts):
        alone = generate(model, torch.tensor(p), max_new_tokens=5, num_steps=3, init_scale=0.0)
        assert [e.token for e in events[i] if isinstance(e, TokenOut)] == alone.token_lists()[0]


# ---------------------------------------------------------------------------------------- deadlines
def run_past_deadline(engine: Engine, prompt: list[int], options: dict, solo: bool) -> tuple[list, float, float]:
    """Submit one job whose work takes minutes with a 1 s deadline; (its events, its start, seconds to
    the first event). (1 s, not less: on a loaded machine a shorter deadline can pass while the job
    still waits in the queue.)"""
    engine.start()
    try:
        failed = threading.Event()
        events = []

        def sink(event):
            events.append(event)
            failed.set()

        opts = GenerationOptions(**options).validate(4, max_depth=engine.model.max_depth)
        start = time.monotonic()
        job = Job(RowRequest(prompt, opts, 0), 2, frozenset(), TextState(TextCodec(None, 256), []),
                  sink, start + 1.0, solo=solo, generation_kwargs=options)
        engine.submit([job])
        assert failed.wait(30)
        elapsed = time.monotonic() - start
    finally:
        engine.stop()
    assert len(events) == 1 and events[0].status == 504 and events[0].error_type == "timeout"
    return events, start, elapsed


@pytest.mark.parametrize("solo", [False, True], ids=["batch", "solo"])
def test_a_deep_prefill_past_its_deadline_ends_within_a_core_step(model, solo, monkeypatch):
    """The deadline is checked between core steps, prefill included: a prompt at 100000 steps (minutes
    of work) with a 1 s timeout fails with a 504 at once, and the engine records its progress."""
    monkeypatch.setattr(model, "max_depth", 100_000)  # (past MAX_NUM_STEPS, as --max-depth raises it)
    engine = Engine(model, max_batch=2)
    assert engine.last_progress is None
    deep = dict(max_new_tokens=2, num_steps=100_000, init_scale=0.0)
    _, start, elapsed = run_past_deadline(engine, list(range(1, 40)), deep, solo)
    assert elapsed < 10  # the full prefill would take minutes
    assert isinstance(engine.last_progress, float) and start < engine.last_progress <= time.monotonic()


def test_a_long_ttt_inner_loop_past_its_deadline_ends_within_an_inner_step(model):
    """TTT-E2E's inner loop runs while the request's session is built, before the core steps' deadline
    check was installed: 100000 inner steps with a 1 s timeout trained on for minutes. (ttt_steps' ceiling, 1024
    inner steps at depth 32: about 30 s on one thread without the check.)"""
    trains = dict(max_new_tokens=2, num_steps=2, init_scale=0.0, ttt_params="core-mlp", ttt_steps=1024, ttt_depth=32,
                  ttt_lr=1e-6)
    _, _, elapsed = run_past_deadline(Engine(model, max_batch=2), list(range(1, 20)), trains, solo=True)
    assert elapsed < 10


def test_a_non_streaming_client_that_left_is_noticed_while_tokens_keep_arriving():
    """`collect` checked for a client that left only when no event came for POLL_SECONDS: a request
    whose tokens arrived faster than that generated on to max_tokens after its client had gone."""
    import asyncio

    from recurrent_depth.serving.responses import Choice
    from recurrent_depth.serving.streaming import Channel, OpenRequests, collect

    class Scheduler:
        cancelled: list = []

        def cancel(self, jobs):
            self.cancelled.extend(jobs)

    class GoneClient:
        async def is_disconnected(self):
            return True

    async def main():
        channel = Channel()

        async def tokens():  # a token every 10 ms, never Done
            while True:
                channel.sink(TokenOut(0, 5, "x", 1, "depth", None, None))
                await asyncio.sleep(0.01)

        producer = asyncio.ensure_future(tokens())
        scheduler = Scheduler()
        jobs = ["job"]
        try:
            with pytest.raises(APIError) as err:
                await asyncio.wait_for(collect(GoneClient(), jobs, [Choice(0, [1])], channel,
                                               OpenRequests(scheduler), time.monotonic() + 60), 3)
        finally:
            producer.cancel()
        assert err.value.status == 499 and scheduler.cancelled == jobs

    asyncio.run(main())


def test_ttt_inner_steps_count_as_progress_for_the_stall_check(model, monkeypatch):
    """/health's stall check watches `last_progress`; TTT-E2E's inner loop (and GradMem's write) ran
    without updating it, so a long adaptation made /health answer 503 "stalled" while the engine worked."""
    from recurrent_depth.inference import ttt_e2e

    engine = Engine(model, max_batch=2)
    seen = []
    loss = ttt_e2e.context_loss

    def recording_loss(*args, **kwargs):
        seen.append(engine.last_progress)
        time.sleep(0.01)
        return loss(*args, **kwargs)

    monkeypatch.setattr(ttt_e2e, "context_loss", recording_loss)
    engine.start()
    try:
        done = threading.Event()
        trains = dict(max_new_tokens=1, num_steps=2, init_scale=0.0, ttt_params="core-mlp", ttt_steps=3, ttt_lr=1e-6)
        opts = GenerationOptions(**trains).validate(4)
        job = Job(RowRequest(list(range(1, 10)), opts, 0), 1, frozenset(), TextState(TextCodec(None, 256), []),
                  lambda event: done.set() if isinstance(event, Done) else None, time.monotonic() + 60, solo=True,
                  generation_kwargs=trains)
        engine.submit([job])
        assert done.wait(30)
    finally:
        engine.stop()
    assert len(seen) == 3 and None not in seen and seen == sorted(set(seen)), seen


@pytest.mark.parametrize("left", ["before the first chunk", "while a chunk is sent"])
def test_a_stream_whose_client_left_always_cancels_its_jobs_and_is_counted(left):
    """Starlette cancels a streaming response when its client leaves: a generator cancelled before its
    first chunk never ran its cleanup, and one cancelled inside `send` (left at a `yield`) ran it only
    when garbage-collected; meanwhile its jobs generated to max_tokens and /metrics never counted it."""
    import asyncio

    from recurrent_depth.serving.responses import Choice
    from recurrent_depth.serving.streaming import Channel, OpenRequests, stream

    class Scheduler:
        def __init__(self):
            self.cancelled = []

        def cancel(self, jobs):
            self.cancelled.extend(jobs)

    async def main():
        channel, scheduler, statuses, jobs = Channel(), Scheduler(), [], ["job"]
        open_requests = OpenRequests(scheduler)
        open_requests.add(jobs, time.monotonic(), channel)
        response = stream(jobs, [Choice(0, [1])], channel, open_requests, time.monotonic() + 60,
                          to_chunks=lambda event, choice: [], final=lambda: None, ended=statuses.append,
                          opening=lambda choice: {"index": choice.index})
        sent = []

        async def receive():
            if left == "while a chunk is sent":
                while len(sent) < 2:  # the response head and the opening chunk are being sent
                    await asyncio.sleep(0.001)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            await asyncio.sleep(0.05)  # a slow socket

        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        assert statuses == [499] and scheduler.cancelled == jobs and open_requests.idle_seconds() is None

    asyncio.run(main())


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_equal_the_whole_answers_at_linear_cost(codec, echo):
    """Each streamed token's logprobs entry recomputed every earlier token's text offset (a quadratic
    stream: 2000 tokens took 12 s of the event loop); it must still equal the whole answer's entries."""
    from recurrent_depth.serving.responses import Choice, completion_chunks, completion_logprobs, echoed_prompt

    req = parse_completion({"prompt": "x", "logprobs": 2, "echo": echo}, Limits(4096, 4, 300), {"m"})
    prompt = codec.encode("héllo 🙂", add_special_tokens=True)
    tokens = codec.encode("wörld 🙂 def add(a, b): return a + b\n" * 10)
    choice, chunks = Choice(0, prompt), []
    calls = 0
    decode = codec.decode

    def counting(ids, *args, **kwargs):
        nonlocal calls
        calls += 1
        return decode(ids, *args, **kwargs)

    codec.decode = counting
    try:
        for t in tokens:
            event = TokenOut(0, t, "", 1, "depth", -0.5, [(t, -0.5), (3, -1.0)])
            choice.tokens.append(t)
            choice.logprobs.append(-0.5)
            choice.tops.append(event.top)
            chunks += completion_chunks(codec, event, choice, req, {})
    finally:
        codec.decode = decode
    entries = [c["choices"][0]["logprobs"] for c in chunks]
    streamed = {k: sum((e[k] for e in entries), []) for k in entries[0]}
    whole = completion_logprobs(codec, choice, echo, first=len(prompt) if echo else 0,
                                echoed=echoed_prompt(codec, req, choice) if echo else None)  # (offsets into it)
    assert streamed == whole
    assert calls < 4 * (len(prompt) + len(tokens)), calls  # linear: a few decodes per token


def test_a_ttt_request_on_a_weight_quantized_server_names_the_reason(model):
    """`rdepth serve --weights int8` turns the linear layers' weights into buffers: `ttt_params: core-mlp`
    was refused as matching "no parameter of this model", not saying why."""
    import copy

    from recurrent_depth.serving.handlers import Handlers, ServerSettings
    from recurrent_depth.weight_quant import quantize_weights

    quantized = copy.deepcopy(model)
    quantize_weights(quantized, "int8")
    handlers = Handlers(Engine(quantized, max_batch=1), TextCodec(None, 256), ServerSettings("m"))
    options = GenerationOptions(max_new_tokens=2, num_steps=2, ttt_params="core-mlp").validate(4)
    with pytest.raises(APIError) as err:
        handlers.check_ttt(8, options, {})
    assert err.value.status == 400 and "--weights" in str(err.value) and "core-mlp" in str(err.value)
