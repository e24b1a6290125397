"""State shared by every decoding mode: inputs, cache, runner, token choice, stops, recording."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.cache import bind_policy, layer_windows, make_cache
from recurrent_depth.inference.criteria import ExitCriterion, gate_for
from recurrent_depth.inference.engine import Pass, Recurrence
from recurrent_depth.inference.options import OFFICIAL_KV_POLICY, OptionError, ResolvedOptions, eos_ids
from recurrent_depth.inference.output import Recorder, TokenEvent
from recurrent_depth.inference.quant_cache import kv_quant_for_model
from recurrent_depth.inference.sampling import RowGenerators, StopChecker, TokenChooser, decode
from recurrent_depth.model.mixers.common import RecurrentMixer
from recurrent_depth.model.recurrent import all_attention, check_scale_has_a_draw, mixers_with

RANDOMIZED_LOOKUP_STREAM = 1  # `RowGenerators.derived` stream of the randomized KV lookup's draws


def prepare_inputs(model: Any, input_ids: Any, attention_mask: Any) -> tuple[Tensor, Tensor | None]:
    """Validate ids `[B, T]` (or `[T]`, or lists) and a left-padding mask; returns tensors on the model's device."""
    cfg = model.config
    if not isinstance(input_ids, Tensor):
        try:  # keep the given type: a cast to long would silently truncate 1.5 to 1
            input_ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"input_ids must be a tensor or a (nested) list of ints: {exc}") from None
    nonint = input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex()
    if nonint and input_ids.numel() > 0:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape [batch>0, seq_len>0], got {tuple(input_ids.shape)}")
    input_ids = input_ids.long()
    bad = (input_ids < 0) | (input_ids >= cfg.vocab_size)
    if bool(bad.any()):
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(
            f"input_ids[{b}, {t}]={int(input_ids[b, t])} is outside the vocabulary [0, {cfg.vocab_size})"
        )
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor):
            try:
                attention_mask = torch.as_tensor(attention_mask)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ValueError(f"attention_mask must be a tensor or a (nested) list of 0/1: {exc}") from None
        if attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
        mask = attention_mask.bool()
        if not bool(mask[:, -1].all()) or bool((mask[:, 1:].long() - mask[:, :-1].long() < 0).any()):
            raise ValueError(
                "attention_mask must describe left padding: each row is zeros (padding) then ones, ending in a "
                "real token; pad on the left"
            )
        if bool(mask.all()):
            mask = None
    device = model.device
    return input_ids.to(device), (mask.to(device) if mask is not None else None)


def adaptive_schedule(num_steps: int, max_steps: int, min_steps: int, check_every: int,
                      min_steps_rule: str) -> dict[str, Any]:
    """The step loop's keyword arguments (`Recurrence.run_adaptive`) for these options: under the "skip"
    rule the first min_steps steps run unchecked; the official loop keeps its last check's logits at max_steps."""
    skip = min_steps_rule == "skip"
    return dict(num_steps=num_steps, max_steps=max_steps, min_steps=1 if skip else min_steps,
                first_check=min_steps + 1 if skip else 1, check_every=check_every, read_last_check=skip)


def check_position_counters(model: Any, policy: Any, rows: int, exit_criterion: str | None, steps: int,
                            padded: bool = False) -> None:
    """Refuse what the mixers whose state counts positions (log-linear, TTT-KVB) cannot keep exact: a batch of
    several rows under left padding (`padded`), an exit criterion (`exit_criterion`, None when none or under
    exit_kv='compute') on a batch of several rows, and a KV `policy` (a name or `KVPolicy`) that shares a core
    slot among the `steps` steps."""
    names = mixers_with(model, "shared_counter")
    if names and rows > 1 and padded:
        # The count is the batch's column, so a padded row's tokens sit at other counts than alone (log-linear:
        # other Fenwick levels; TTT-KVB: other mini-batch boundaries) and get other logits.
        raise ValueError(
            f"a left-padded batch of {rows} rows: the {', '.join(names)} mixer keeps one position count for all "
            "rows, which padding shifts for the shorter prompts; give prompts of one length or generate one row "
            "at a time"
        )
    if names and rows > 1 and exit_criterion is not None:
        raise ValueError(
            f"exit_criterion={exit_criterion!r} on a batch of {rows} rows: the {', '.join(names)} mixer keeps one "
            "position count for all rows, which rows that exit at different steps would disagree on; generate "
            "one row at a time or use exit_kv='compute'"
        )
    names = mixers_with(model, "absolute_positions")
    if not names:
        return
    layers = model.config.core_layers
    policy = bind_policy(policy, None, layers)
    slots = policy.slots.num_slots(steps)
    if len({policy.split(("core", j, i), slots) for j in range(layers) for i in range(steps)}) < steps * layers:
        raise ValueError(
            f"kv_policy={policy.name!r} shares a core cache slot among steps, but the {', '.join(names)} "
            "mixer counts absolute positions in its state, which a shared slot would advance once per step; "
            "use the default per-step policy"
        )


def check_policy_for_model(model: Any, options: ResolvedOptions) -> None:
    """A one-line ValueError when the KV policy's lookup needs softmax attention the model lacks."""
    lookup = options.policy.lookup
    if (lookup.hides_columns or lookup.reads_per_step) and not all_attention(model):
        # a slot shared among core layers (compress-rN) takes no 'deepest' lookup: another slot rule is the way out
        advice = ("use the 'deepest' lookup" if options.policy.slots.per_layer
                  else f"{options.policy.slots.name} takes only the 'full' and 'skip' lookups: use another slot rule")
        # (the official profile's own pick with an exit criterion: the caller may never have named a kv_policy)
        source = (" (defaults='official' picks it with an exit criterion)"
                  if options.defaults == "official" and options.kv_policy == OFFICIAL_KV_POLICY else "")
        raise ValueError(
            f"kv_policy={options.kv_policy!r}{source} hides or picks cache entries of the attention, which needs every "
            f"layer to be softmax attention; this model's mixer is {model.config.mixer!r} ({advice})"
        )


def check_mode_for_model(model: Any, options: ResolvedOptions) -> None:
    """A one-line ValueError when the decoding mode cannot run on this model, raised before any work (a
    caller may print the prompt once the session exists)."""
    mode = options.mode
    if mode == "autoregressive":
        return
    # (the option that chose the mode is named: an interface re-spells it as its flag or field)
    what = (f"self-speculative decoding (draft_steps={options.draft_steps})" if mode == "speculative"
            else "the parallel sampler (sampler='parallel')")
    # Both modes re-run cached positions; a recurrent state (linear-attention mixers) has absorbed them for good.
    parts = {"prelude": model.transformer.prelude, "core": model.transformer.core_block,
             "coda": model.transformer.coda}
    stateful = [name for name, blocks in parts.items() if any(isinstance(b.attn, RecurrentMixer) for b in blocks)]
    if stateful:
        raise ValueError(
            f"{what} re-runs positions already in the cache, which the recurrent-state mixers of this "
            f"model ({', '.join(stateful)} layers: {model.config.mixer!r}) cannot undo; use the "
            "default autoregressive mode"
        )
    cfg = model.config
    if mode == "parallel" and (cfg.injection == "none" or cfg.state_init != "random"):
        # A position's guessed token reaches its state only through the injection, and its state starts
        # from noise: a model looped on its own embedding (Ouro) would refine a guess it never revises.
        raise ValueError("sampler='parallel' needs a model with an input injection and a random s_0 (Huginn's); "
                         "this model loops its embedding (injection='none'): decode autoregressively")


def short_prompt_option(options: ResolvedOptions) -> str | None:
    """The option that lets a decoded token run core steps the prompt may not have run (an exit criterion in
    the autoregressive mode with max_steps > num_steps, or with exit_in_prefill), or None."""
    if options.mode != "autoregressive" or options.criterion is None:
        return None
    if options.exit_in_prefill and options.criterion.name != "none":  # ("none" runs the prompt to max_steps)
        return "exit_in_prefill"
    return "max_steps" if options.max_steps > options.num_steps and not options.exit_in_prefill else None


def check_depth_for_model(model: Any, options: ResolvedOptions) -> None:
    """A one-line ValueError when a token may run a core step the prompt did not, on a model whose core keeps a
    recurrent state: that step has no state of the earlier positions (the generation died there with a
    RuntimeError, and in a batch a row read the state another row's prompt wrote)."""
    name = short_prompt_option(options)
    stateful = any(isinstance(block.attn, RecurrentMixer) for block in model.transformer.core_block)
    if name is None or not stateful:
        return
    if name == "exit_in_prefill":
        cause = f"exit_in_prefill=True lets the prompt stop before max_steps={options.max_steps}"
    else:
        cause = f"max_steps={options.max_steps} runs tokens deeper than the prompt's num_steps={options.num_steps}"
    raise ValueError(
        f"{cause}, but this model's core mixer ({model.config.mixer!r}) keeps a recurrent state per step that "
        "holds no earlier position at the steps the prompt skipped; set max_steps <= num_steps and "
        "exit_in_prefill=False"
    )


def check_warm_start_for_model(model: Any, options: ResolvedOptions) -> None:
    """A one-line ValueError for warm start on a model that reads each token only through its s_0."""
    if options.warm_start and model.config.injection == "none":
        # s_0 = e is the token's only way in (no injection at the steps): the previous token's state would
        # replace it, and every token would get the logits of whatever it was fed.
        raise ValueError(
            "warm_start replaces s_0, but this model loops its embedding (injection='none', Ouro's layout): "
            "s_0 = e is the only way a token enters the recurrence, so each token would ignore what it was fed; "
            "decode without warm_start"
        )


def check_options_for_model(model: Any, options: ResolvedOptions) -> None:
    """Every refusal of `options` that depends only on the model, before any work (a caller may print the
    prompt once the session exists), as the `OptionError` of the option at fault, so that each interface
    names it in its own terms (a CLI flag, a JSON field)."""
    checks = (
        ("kv_policy", lambda: check_policy_for_model(model, options)),
        ("sampler" if options.mode == "parallel" else "draft_steps", lambda: check_mode_for_model(model, options)),
        ("kv_quant", lambda: options.kv_quant is None or kv_quant_for_model(model, options.kv_quant)),
        ("exit_criterion", lambda: gate_for(options.criterion, model)),  # the gate criterion needs an exit gate
        ("warm_start", lambda: check_warm_start_for_model(model, options)),
        ("init_scale", lambda: check_scale_has_a_draw(model.config, options.init_scale)),  # (the forward's check)
        (short_prompt_option(options) or "max_steps", lambda: check_depth_for_model(model, options)),
    )
    for name, check in checks:
        try:
            check()
        except ValueError as exc:
            raise OptionError(name, str(exc)) from None


class Session:
    """One generation call: everything the mode loops read and update."""

    def __init__(self, model: Any, input_ids: Tensor, mask: Tensor | None, options: ResolvedOptions,
                 tokenizer: Any = None, embedded: Tensor | None = None) -> None:
        """embedded: bool `[B, T]`, the prompt columns whose input is an embedding rather than their id
        (GradMem's memory tokens): `prompt_embeds` must hold the prompt's embeddings before the prefill,
        and those columns do not count as seen tokens for the repetition penalty."""
        cfg = model.config
        self.model = model
        self.options = options
        self.tokenizer = tokenizer
        self.input_ids = input_ids
        self.B, self.T = input_ids.shape
        self.device = input_ids.device
        self.vocab_size = cfg.vocab_size
        prompt_valid = mask if mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        longest = int(prompt_valid.sum(dim=1).max())
        if longest + options.max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {options.max_new_tokens} exceeds the model's "
                f"max_seq_len={cfg.max_seq_len}"
            )
        # Official defaults on a bf16 / fp16 model run the model's own modules, which round as the official code
        # does: the fused runner's split adapter and C++ weight stream differ in a last bit that the recurrence
        # amplifies into other tokens (docs/inference.md).
        low_precision = getattr(model, "dtype", None) in (torch.bfloat16, torch.float16)
        self.engine = Recurrence(model, options.fast and not (options.defaults == "official" and low_precision))
        self.runner = self.engine.runner
        lookup = options.policy.lookup
        # Columns: the prompt, the new tokens, and room for a speculative round or a wavefront.
        # (A round drafts at most max_seq_len tokens and a sweep adds at most max_new_tokens positions.)
        if options.mode == "speculative":
            slack = min(options.lookahead, cfg.max_seq_len) + 1
        else:
            slack = min(options.headway, options.max_new_tokens) + 1
        self.cache = make_cache(
            options.cache_implementation, self.B, options.deepest_step,
            capacity=self.T + options.max_new_tokens + slack, device=self.device, policy=options.policy,
            core_layers=cfg.core_layers, kv_quant=options.quant,
            # sliding-window layers drop the columns no window reaches (inference/cache.py; a speculative round's
            # rollback sets `window_back`, the wavefront never seeks behind its last write's start)
            windows=layer_windows(model),
        )
        if mask is not None:
            self.cache.mark_prompt(prompt_valid)
        # valid[b, c]: column c of row b is a real token (left padding and rejected drafts are not).
        self.padded = mask is not None
        self.valid = torch.ones(self.B, self.T + options.max_new_tokens + slack, dtype=torch.bool,
                                device=self.device)
        self.valid[:, : self.T] = prompt_valid
        # Under official defaults without a seed, every draw comes from torch's global RNG as in the official code
        # (so the same torch.manual_seed gives its s_0 and its tokens); the randomized lookup's too.
        global_rng = options.defaults == "official" and options.seed is None
        self.generators = RowGenerators(options.seed, self.B, self.device, global_rng=global_rng)
        if lookup.name == "randomized" and not global_rng:  # its draws come from the seed too, row by row
            self.cache.lookup_generators = self.generators.derived(RANDOMIZED_LOOKUP_STREAM)
        self.chooser = TokenChooser(options, cfg.vocab_size, self.generators)
        self.embedded = embedded
        self.prompt_embeds: Tensor | None = None  # [B, T, h] the prelude's input where `embedded` is set
        self.chooser.observe_prompt(input_ids, prompt_valid if embedded is None else prompt_valid & ~embedded)
        stop_ids = options.stop_ids(cfg.eos_token_id, cfg.vocab_size)
        self.stops = StopChecker(options.stop, stop_ids, cfg.vocab_size, tokenizer)
        self.recorder = Recorder(self.B, options.max_new_tokens, options.output_logits)
        config_eos = eos_ids(cfg.eos_token_id, "eos_token_id", cfg.vocab_size)
        self.pad_token_id = next((t for t in (cfg.pad_token_id, *config_eos) if t is not None), 0)
        self.criterion = (ExitCriterion(options.criterion, options.threshold, gate_for(options.criterion, model))
                          if options.criterion else None)
        self.schedule = adaptive_schedule(options.num_steps, options.max_steps, options.min_steps,
                                          options.check_every, options.min_steps_rule)
        # exit_kv="compute" (`Recurrence.run_computing`): every step runs, under the "exit" rule.
        self.computing = options.exit_kv == "compute" and self.criterion is not None
        self.compute_schedule = dict(max_steps=options.max_steps, min_steps=options.min_steps,
                                     check_every=options.check_every)
        self._check_position_counters()
        self.teacher = self._teacher(options.teacher_tokens)
        self.stats: dict[str, Any] = {}

    def _check_position_counters(self) -> None:
        """(Speculative and parallel decoding refuse every recurrent state, with their own message.)"""
        if self.options.mode == "autoregressive":
            exits = self.criterion is not None and not self.computing
            check_position_counters(self.model, self.options.policy, self.B,
                                    self.options.criterion.name if exits else None, self.options.deepest_step,
                                    padded=self.padded)

    def _teacher(self, tokens: Any) -> list[list[int]] | None:
        """Teacher forcing: feed these `[B, >= max_new_tokens]` ids instead of the chosen ones."""
        if tokens is None:
            return None
        try:  # (a string or a ragged list: one line naming the option, not torch's TypeError)
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"teacher_tokens must be a tensor or a (nested) list of token ids: {exc}") from None
        if tokens.dim() == 1:
            tokens = tokens[None]
        n = self.options.max_new_tokens
        if tokens.dim() != 2 or tokens.shape[0] != self.B or tokens.shape[1] < n:
            raise ValueError(
                f"teacher_tokens must have shape [batch={self.B}, >= max_new_tokens={n}], got {tuple(tokens.shape)}"
            )
        if tokens.dtype.is_floating_point or bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(f"teacher_tokens must be token ids in [0, {self.vocab_size})")
        return tokens[:, :n].tolist()

    def forced(self, row: int, chosen: int) -> int:
        """The token to commit at a row's next position: the teacher's when teacher forcing."""
        if self.teacher is None:
            return chosen
        return self.teacher[row][self.recorder.count(row)]

    # ------------------------------------------------------------------ columns and masks
    def _ensure_columns(self, n: int) -> None:
        if self.valid.shape[1] < n:
            grown = torch.ones(self.B, max(n, 2 * self.valid.shape[1]), dtype=torch.bool, device=self.device)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown

    def mask(self, end: int) -> Tensor | None:
        """The attention mask for columns [0, end), or None when every column is real."""
        self._ensure_columns(end)
        return self.valid[:, :end] if self.padded else None

    def hide(self, row: int, start: int, end: int) -> None:
        """Mark columns [start, end) of a row as not real (a rejected draft left in the cache)."""
        self.valid[row, start:end] = False
        self.padded = True

    @property
    def cache_windows(self) -> dict[tuple, int]:
        """The sliding windows of the cache's windowed layers (by layer base; empty: none, or the bound is off)."""
        return self.cache.windows

    def hold_back(self, columns: int) -> None:
        """Windowed layers keep `columns` more than their windows from here on: what a later write seeks back over
        (a speculative verify over its drafts) and the multi-query reads' slack (inference/cache.py)."""
        self.cache.window_back = columns

    # ------------------------------------------------------------------ rows
    @property
    def unfinished(self) -> list[int]:
        return [b for b in range(self.B) if not self.recorder.finished[b]]

    def unfinished_mask(self) -> Tensor:
        return torch.tensor([not f for f in self.recorder.finished], dtype=torch.bool, device=self.device)

    def initial_states(self, like: Tensor, rows: list[int], valid: Tensor | None = None) -> Tensor:
        """s_0 `[B, T, h]` for the injection `like` = e: zeros for init_scale 0; otherwise each row in `rows`
        draws from its own generator for its real columns only (so the draw matches the row run alone).
        A model whose s_0 is e itself (`state_init="embedding"`, Ouro) gets e whatever init_scale says."""
        scale = self.options.init_scale
        s = torch.zeros_like(like)
        if scale == 0 and self.model.config.state_init == "random" and not self.generators.global_rng:
            return s
        # the official draw: the whole batch at once (at init_scale 0 too, whose zeros follow a draw there)
        if self.generators.global_rng and valid is None:
            draw = self.runner.initial_state(like, scale, None)
            s[rows] = draw[rows]
            return s
        for b in rows:
            cols = valid[b].nonzero().squeeze(1) if valid is not None else None
            # (the row's real columns: an s_0 = e model starts from their embeddings, not the padding's)
            real = like[b : b + 1] if cols is None else like[b : b + 1, cols]
            draw = self.runner.initial_state(real, scale, self.generators[b])
            if cols is None:
                s[b] = draw[0]
            else:
                s[b, cols] = draw[0]
        return s

    # ------------------------------------------------------------------ recording
    def commit(self, row: int, token: int, steps: int, reason: str, logits: Tensor | None,
               cache_bytes: int | None) -> TokenEvent:
        """Append the chosen token (or the teacher's) to a row, apply stop rules (not under teacher
        forcing), and describe it as a stream event. The committed token is `event.token`."""
        rec = self.recorder
        prediction = token
        token = self.forced(row, token)
        index = rec.add(row, token, steps, reason, logits, prediction)
        if cache_bytes is not None:
            rec.set_bytes(row, cache_bytes)
        if self.teacher is None and (token in self.stops.ids or self.stops.hits_string(rec.tokens[row])):
            rec.finish(row, "stop")
        text = decode(self.tokenizer, [token]) if self.tokenizer is not None else None
        return TokenEvent(row=row, index=index, token=token, steps=steps, reason=reason,
                          finished=rec.finished[row], cache_bytes=cache_bytes, text=text)

    def row_bytes(self, end: int | None = None, row_ends: list[int] | None = None) -> list[int]:
        """Logical KV bytes per row over columns [0, end) (default: the cached columns), or over
        [0, row_ends[b]) for row b."""
        end = self.cache.seq_len if end is None else end
        self._ensure_columns(end)
        valid = self.valid[:, :end]
        if row_ends is not None:
            limits = torch.tensor(row_ends, device=self.device)[:, None]
            valid = valid & (torch.arange(end, device=self.device)[None] < limits)
        return self.cache.logical_nbytes(valid, end=end).tolist()

    # ------------------------------------------------------------------ prefill
    def _begin_prompt(self) -> Pass:
        """The prompt's pass: prelude of its ids, or of `prompt_embeds` when some columns are embeddings."""
        if self.embedded is not None and self.prompt_embeds is None:
            raise RuntimeError("this session's prompt has embedded columns: set prompt_embeds before the prefill")
        return self.engine.begin(self.input_ids, self.mask(self.T), self.cache, inputs_embeds=self.prompt_embeds)

    def prefill(self, depth: int) -> tuple[Tensor, Tensor]:
        """Run the prompt at full depth; returns (last raw state `[B, h]`, last logits `[B, V]`)."""
        engine, cache = self.engine, self.cache
        pass_ = self._begin_prompt()
        s = self.initial_states(pass_.e, list(range(self.B)), self.valid[:, : self.T] if self.padded else None)
        s = engine.run(s, pass_, depth)
        logits = engine.readout(s, pass_, last_only=True)[:, 0]
        cache.close(depth, self.T)
        cache.advance(self.T)
        return s[:, -1], logits

    def computing_prefill(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """exit_kv="compute": the prompt runs `num_steps` steps (every KV entry), its last position is
        read at the step its criterion first holds. Returns (that raw state `[B, h]`, its logits
        `[B, V]`, exit steps `[B]`, exit codes `[B]`)."""
        engine, cache = self.engine, self.cache
        pass_ = self._begin_prompt()
        s = self.initial_states(pass_.e, list(range(self.B)), self.valid[:, : self.T] if self.padded else None)
        schedule = dict(self.compute_schedule, max_steps=self.options.num_steps)
        s, logits, used, codes = engine.run_computing(s, pass_, self.criterion, self.vocab_size, **schedule)
        cache.close(self.options.num_steps, self.T)
        cache.advance(self.T)
        return s[:, -1], logits, used, codes

    def adaptive_prefill(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Run the prompt under the exit criterion (`exit_in_prefill`): a row's positions stop
        together. Returns (last raw state `[B, h]`, last logits `[B, V]`, steps `[B]`, exit codes `[B]`)."""
        engine, cache = self.engine, self.cache
        valid = self.valid[:, : self.T] if self.padded else None
        pass_ = self._begin_prompt()
        s = self.initial_states(pass_.e, list(range(self.B)), valid)
        s, logits, used, codes = engine.run_adaptive(s, pass_, self.criterion, self.vocab_size,
                                                     valid=valid, **self.schedule)
        cache.close(used[:, None].expand(self.B, self.T).contiguous(), self.T)
        cache.advance(self.T)
        return s[:, -1], logits, used, codes
