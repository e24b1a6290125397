"""`generate` and `stream_generate`: one entry point for every decoding mode."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, get_type_hints

import torch
from torch import Tensor

from recurrent_depth.config import ModelConfig
from recurrent_depth.inference import autoregressive, parallel, speculative
from recurrent_depth.inference.gradmem import GradMemPlan, read_prompt
from recurrent_depth.inference.options import (
    OPTIONS,
    GenerationOptions,
    OptionError,
    ResolvedOptions,
    spelled_warnings,
)
from recurrent_depth.inference.output import GenerationOutput, TokenEvent
from recurrent_depth.inference.schema import OFFICIAL_ALIASES, canonical, kwarg_spelling, unknown_names
from recurrent_depth.inference.session import Session, check_options_for_model, prepare_inputs
from recurrent_depth.inference.ttt_e2e import NOTHING_GENERATED, Adaptation, adapt, skipped
from recurrent_depth.model.recurrent import library_model

_LOOPS = {"autoregressive": autoregressive.decode, "speculative": speculative.decode, "parallel": parallel.decode}


class GenerationStream:
    """Iterate to receive `TokenEvent`s as tokens are committed; `.output` holds the result after.

    Rows of a batch may commit at different rates (speculative and parallel modes), so events
    carry their row and index.
    """

    def __init__(self, model: Any, input_ids: Any, attention_mask: Any, options: GenerationOptions,
                 tokenizer: Any, memory: Tensor | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        config = model.config
        resolved = options.validate(config.mean_recurrence, config.exit_gate_threshold, config.init_scale,
                                    model.max_depth)
        check_options_for_model(model, resolved)  # before TTT-E2E or GradMem work, and before any event
        self.options: ResolvedOptions = resolved
        self.gradmem: GradMemPlan | None = None
        self.adaptation: Adaptation | None = None
        if memory is not None:  # a memory written before: the prompt is [memory; input_ids]
            if resolved.gradmem_tokens:
                raise OptionError("gradmem_tokens", "gradmem_tokens writes a memory from the prompt, but a memory "
                                  "was given to read: leave gradmem_tokens at 0")
            if resolved.ttt_params is not None:
                raise OptionError("ttt_params", "ttt_params trains on the prompt's tokens, but a written memory "
                                  "was given to read: leave ttt_params unset")
            self.model = model
            ids, mask, embedded, embeds = read_prompt(model, memory, input_ids, attention_mask)
            self.prompt_ids = ids
            self.session = Session(model, ids, mask, resolved, tokenizer, embedded=embedded)
            self.session.prompt_embeds = embeds
            self.session.engine.should_stop = should_stop
            self.output: GenerationOutput | None = None
            return
        ids, mask = prepare_inputs(model, input_ids, attention_mask)
        self.prompt_ids = ids  # what `output.sequences` starts with (GradMem's session reads another prompt)
        # TTT-E2E: the inner loop trains a shadow of the model (its chosen weights copied) and the
        # session generates from it; `model` itself is never written (inference/ttt_e2e.py).
        if resolved.ttt_params is not None:
            prompt = ids if mask is None else ids[:, mask[0].nonzero()[0, 0]:]
            if resolved.max_new_tokens == 0:  # nothing generated reads the weights: the checks, no inner loop
                self.adaptation = skipped(model, prompt, resolved, NOTHING_GENERATED)
            else:
                self.adaptation = adapt(model, prompt, resolved, should_stop=should_stop)
            model = self.adaptation.model
        self.model = model
        # GradMem: the session's prompt is [memory; query], the memory written when iteration starts.
        self.gradmem = GradMemPlan.split(model, ids, mask, resolved) if resolved.gradmem_tokens else None
        if self.gradmem is not None:
            plan = self.gradmem
            self.session = Session(model, plan.read_ids, plan.read_mask, resolved, tokenizer, embedded=plan.embedded)
        else:
            self.session = Session(model, ids, mask, resolved, tokenizer)
        if self.adaptation is not None:
            self.session.stats.update(self.adaptation.stats())
        self.session.engine.should_stop = should_stop
        self.output = None

    def __iter__(self) -> Iterator[TokenEvent]:
        if self.output is not None:
            raise RuntimeError("a GenerationStream can be iterated only once")
        session = self.session
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        first_token_at = None
        try:
            if self.gradmem is not None:
                self.gradmem.write(session)  # gradients: before the loop's inference mode
            loop = _LOOPS[self.options.mode] if self.options.max_new_tokens > 0 else _nothing
            with torch.inference_mode():
                for event in loop(session):
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                    yield event
        finally:
            self.model.train(was_training)
        finish = time.perf_counter()
        prefill = (first_token_at or finish) - start
        cache = session.cache
        core = cache.logical_nbytes(session.valid[:, : cache.seq_len], core_only=True)
        self.output = session.recorder.build(
            self.prompt_ids, session.pad_token_id,
            cache_allocated_bytes=cache.nbytes(), core_cache_bytes=core.cpu(), mode=self.options.mode,
            kv_policy=cache.policy.name,
            prefill_seconds=prefill, decode_seconds=finish - start - prefill, stats=dict(session.stats),
        )


def _nothing(session: Session) -> Iterator[TokenEvent]:
    """max_new_tokens=0: no prefill, no tokens."""
    yield from ()


def _options(kwargs: dict[str, Any]) -> tuple[GenerationOptions, Any, Any, dict[str, str]]:
    """Keyword arguments (ours or the official aliases) -> options, tokenizer, streamer, and the
    names the caller used (errors speak of those)."""
    tokenizer = _decoder(kwargs.pop("tokenizer", None))
    streamer = kwargs.pop("streamer", None)
    if streamer is not None and not callable(streamer):  # (else a TypeError at the first token, after the prefill)
        raise TypeError(f"streamer must be a callable receiving each TokenEvent, got {type(streamer).__name__}")
    unknown = unknown_names(kwargs, GenerationOptions.names() | set(OFFICIAL_ALIASES))
    if unknown:
        raise ValueError(
            f"unknown generation argument(s) {unknown}; known: {sorted(GenerationOptions.names())} and the "
            f"official names {sorted(OFFICIAL_ALIASES)}"
        )
    values, given_as = canonical(kwargs)
    return GenerationOptions(**values), tokenizer, streamer, given_as


def _decoder(tokenizer: Any) -> Any:
    """`generate`'s tokenizer=: a `tokenizers.Tokenizer` or a transformers tokenizer as given, a directory (or
    tokenizer.json) loaded; anything without `decode` is refused here, not at the first stop-string check."""
    if isinstance(tokenizer, str | os.PathLike):
        from recurrent_depth.data.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer or a directory holding "
                        f"tokenizer.json, got {type(tokenizer).__name__}")
    return tokenizer


def _runtime_model(model: Any) -> Any:
    """The recurrent-depth model that runs `model`: a model loaded through transformers runs as the library
    model it holds (its config is transformers' one, which the runtime cannot read). Anything else is refused
    in one line, before any option is read."""
    model = library_model(model)
    if not isinstance(getattr(model, "config", None), ModelConfig):
        raise ValueError(
            f"generate takes a recurrent-depth model (RecurrentDepthLM, or a transformers class holding one), got "
            f"{type(model).__name__}: a transformers model looped by recurrent_depth.looping (`rdepth loop`) "
            "decodes with its own model.generate; `rdepth retrofit` converts a Llama-style model into ours"
        )
    return model


def _stream(model: Any, input_ids: Any, attention_mask: Any, options: GenerationOptions, tokenizer: Any,
            given_as: dict[str, str], should_stop: Callable[[], bool] | None = None) -> GenerationStream:
    model = _runtime_model(model)
    try:
        if not given_as:  # (a caller's own spelling, the CLI's, stays in force)
            return GenerationStream(model, input_ids, attention_mask, options, tokenizer, should_stop=should_stop)
        with spelled_warnings(kwarg_spelling(given_as)):
            return GenerationStream(model, input_ids, attention_mask, options, tokenizer, should_stop=should_stop)
    except OptionError as exc:
        if not given_as:
            raise
        raise exc.spelled(kwarg_spelling(given_as)) from None


def stream_generate(model: Any, input_ids: Any, attention_mask: Any = None,
                    should_stop: Callable[[], bool] | None = None, **kwargs: Any) -> GenerationStream:
    """Like `generate`, but returns a `GenerationStream` that yields each token as it is committed.

    should_stop: checked between core steps and between TTT-E2E / GradMem inner steps (a client's
    deadline); when it returns True the stream raises `inference.engine.Stopped`, from the call
    itself while TTT-E2E adapts, else from the iteration.
    """
    options, tokenizer, streamer, given_as = _options(kwargs)
    if streamer is not None:
        raise ValueError("stream_generate yields events itself; pass streamer= to generate instead")
    return _stream(model, input_ids, attention_mask, options, tokenizer, given_as, should_stop)


def generate(
    model: Any,
    input_ids: Tensor | list,
    *,
    attention_mask: Tensor | None = None,
    streamer: Callable[[TokenEvent], Any] | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> GenerationOutput:
    """Generate from a recurrent-depth model with every test-time compute control.

    input_ids: `[B, T]` (or `[T]`) token ids; attention_mask: `[B, T]` 1 = token, 0 = left padding.
    options: the `GenerationOptions` fields by name (or the official aliases, `schema.OFFICIAL_ALIASES`);
      the signature lists each with its default, and "Options" below with its help. An option left
      out takes its field's default.
    num_steps: recurrence depth r (None: the config's mean_recurrence). The prompt runs at r unless
      exit_in_prefill.
    defaults: None (ours, the paper's) or "official": every option left unset takes the official
      code's default (exit in prefill, its min_steps rule, kl 1e-3, its warm-start source and
      stops, the speculative last round); see `GenerationOptions` and docs/inference.md.

    Depth control, one token at a time (the default mode):
      exit_criterion: None (fixed depth r) or "kl" | "minp-kl" | "entropy-diff" | "latent-diff" |
        "cosine" | "argmax-stability" | "gate" (the learned exit of models with an exit gate, Ouro) |
        "none": each row stops its recurrence on its own (see `criteria.py`);
      exit_threshold: None = the criterion's default (kl 5e-4, minp-kl 1e-5, entropy-diff 1e-3,
        latent-diff 0.03, cosine 1e-3, argmax-stability 5, gate 1); min_steps and max_steps bound the
        steps; min_steps_rule "exit" (ours) or "skip" (official: nothing is checked before step
        min_steps + 1); check_every=n evaluates the criterion every n-th step; exit_in_prefill lets
        the prompt exit too; exit_kv="compute" keeps an exited token computing every step's KV (its
        output stays its exit step's: Ouro's reference loop), "lookup" (default) lets the KV policy's
        lookup rule serve the steps it skipped;
      warm_start: s_0 of a token = the final state of the previous one (continuous CoT), raw or,
        with warm_start_source="normed", after ln_f.
    KV cache: kv_policy="<slots>[+<lookup>]" (see `recurrent_depth.model.cache`): slots "per-step"
      (one entry per step), "shared-K" (step i reads and writes slot i mod K) or "last-step"
      (= shared-1); lookup for tokens that exited early "deepest" (read their deepest entry of the
      same core layer) or "skip" (leave them out at steps they did not reach); or an official
      `cache_lookup_strategy` name ("full", "latest-m4-compress-s16", ...; docs/inference.md lists
      each with its general rule). kv_budget=k is the same as "shared-k". cache_implementation
      "static" (preallocated) or "dynamic" (the plain reference). kv_quant quantizes the entries.
    Self-speculative: draft_steps=N drafts `lookahead` tokens at N steps, verified at r steps in one
      forward; verification_threshold=1 (exact: identical to greedy at r) or < 1 (accept a draft whose
      verifier probability is at least threshold * the top probability).
    Parallel: sampler="parallel" runs the diffusion-forcing style wavefront sampler (inner_steps core
      steps per sweep, at most max_steps; headway new positions per sweep while fewer than wavefront
      refine, max_wavefront forces the front to freeze; positions freeze on exit_criterion
      latent-diff/cosine or at max_steps).
    Sampling: do_sample with temperature, top_k, top_p, min_p; repetition_penalty (1.0 = off) applies to
      greedy too. seed: int (row b uses seed + b) or one int per row; each row draws s_0 and samples
      from its own generator, so a row in a batch equals the row alone. init_scale scales s_0 (None:
      the model config's, as its forward: Huginn's 1.0, Parcae's 1/sqrt(h)); init_scale=0 gives s_0 = 0.
    Stopping: stop ids and stop strings (strings need `tokenizer=`: a `tokenizers.Tokenizer`, a transformers
      tokenizer or a directory holding tokenizer.json), and the eos ids: eos_token_id=
      (an id or a list) or else the config's. finish_round=True lets a speculative row finish the
      round that reaches max_new_tokens.
    GradMem (`recurrent_depth.inference.gradmem`, docs/test-time-training.md): gradmem_tokens=m > 0
      writes each prompt's context (all but its last gradmem_query_tokens tokens) into m memory
      tokens by gradmem_steps SGD steps (gradmem_lr) on the context's next-token loss at depth
      gradmem_depth (default num_steps), the model frozen; the rows then generate from [memory;
      query] with the context dropped. gradmem_init "tail" starts the memory from the context's last
      m token embeddings, "random" from seeded vectors. `.stats` holds gradmem_flops (the write's
      forward + backward FLOPs), gradmem_losses and gradmem_seconds; `.sequences` starts with the
      prompt as given.
    TTT-E2E (`recurrent_depth.inference.ttt_e2e`, docs/test-time-training.md): ttt_params (a named
      subset "core-mlp" | "core" | "prelude" | "coda" | "all", or globs over parameter names) trains
      a copy of those weights for ttt_steps steps (ttt_optimizer "sgd" | "adam", ttt_lr) on the
      prompt's next-token loss at depth ttt_depth (default num_steps) with its last ttt_backprop
      steps under autograd, then generates from the updated copy; `model` is never written. One
      prompt per call. `.stats` holds ttt_flops (the inner passes' FLOPs), ttt_losses, ttt_copy_mb.
    streamer: a callable receiving each `TokenEvent` as it is committed. output_logits=True keeps
      the logits of every chosen token. fast=False uses the model's own modules (reference runner).

    Returns a `GenerationOutput` (`.sequences [B, T + new]`, `.steps [B, new]`, `.exit_reasons`,
    `.cache_bytes [B, new]`, `.lengths`, `.finish_reasons`, timings, mode statistics).
    """
    given, tokenizer, _, given_as = _options(dict(options, tokenizer=tokenizer, streamer=streamer))
    stream = _stream(model, input_ids, attention_mask, given, tokenizer, given_as)
    for event in stream:
        if streamer is not None:
            streamer(event)
    assert stream.output is not None
    return stream.output


def generate_from_memory(
    model: Any,
    memory: Tensor,
    query_ids: Tensor | list | None = None,
    *,
    attention_mask: Tensor | None = None,
    streamer: Callable[[TokenEvent], Any] | None = None,
    tokenizer: Any = None,
    **options: Any,
) -> GenerationOutput:
    """Generate from a GradMem memory written before (`gradmem.write_memory(...).memory`, `[B, m, h]`
    or `[m, h]`): the prompt is [memory; query], as `generate` reads it with `gradmem_tokens`, so
    one memory can answer many queries without writing it again.

    query_ids: `[B, Tq]` (or `[Tq]`) left-padded with `attention_mask`, as `generate`'s input_ids,
    or None (generation continues from the memory). options: `generate`'s (gradmem_tokens stays 0).
    `.sequences` starts with the read prompt, a placeholder id at each memory column; the new tokens
    are `.new_tokens` / `.token_lists()`.
    """
    given, tokenizer, _, given_as = _options(dict(options, tokenizer=tokenizer, streamer=streamer))
    try:
        stream = GenerationStream(_runtime_model(model), query_ids, attention_mask, given, tokenizer, memory=memory)
    except OptionError as exc:
        if not given_as:
            raise
        raise exc.spelled(kwarg_spelling(given_as)) from None
    for event in stream:
        if streamer is not None:
            streamer(event)
    assert stream.output is not None
    return stream.output


def _with_option_parameters(function: Callable[..., Any]) -> None:
    """`function`'s signature and docstring list every option (its field's default and help), so
    `help()` and editors show them; they are read from `GenerationOptions`, not written here."""
    signature = inspect.signature(function)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = get_type_hints(GenerationOptions)
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=hints[name])
               for name, o in OPTIONS.items() if name not in signature.parameters]
    function.__signature__ = signature.replace(parameters=[*fixed, *options])  # type: ignore[attr-defined]
    lines = [f"      {name}: {o.help} (default: {o.shown_default()})" for name, o in OPTIONS.items()]
    function.__doc__ = (function.__doc__ or "") + "\n    Options:\n" + "\n".join(lines) + "\n"


_with_option_parameters(generate)
_with_option_parameters(generate_from_memory)
