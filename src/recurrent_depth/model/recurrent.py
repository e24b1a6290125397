"""The recurrent-depth language model (Huginn-0125 architecture).

    e    = prelude(wte(x) * sqrt(h))                     input injection, computed once
    s_0  ~ TruncNormal(0, sigma^2, ±3 sigma) * sqrt(h)   sigma = sqrt(2 / (5h)) * init_scale
    s_i  = core(adapter(concat[s_{i-1}, e]))             i = 1..r, the same weights every step
    p    = lm_head(ln_f(coda(ln_f(s_r))))                ln_f is used twice, logits in float32

`num_steps` chooses r: an int runs r steps under autograd; a pair (n, k) runs n steps without
gradients and k with (truncated backprop, the state entering the k steps is detached while the
prelude output e still receives gradients); None samples a depth in training mode (the paper's
log-normal Poisson, `model/depth.py`, drawn from the forward's `generator`) and uses
`mean_recurrence` in eval mode. Parameter names equal the official checkpoint's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from recurrent_depth.checkpoint import load_pretrained, save_pretrained
from recurrent_depth.config import (
    FIXED_FAN_IN_MODULES,
    MAX_NUM_STEPS,
    MODEL_PARTS,
    ModelConfig,
    is_real,
    rope_scaling_key,
)
from recurrent_depth.model.cache import ModelCache
from recurrent_depth.model.depth import DepthSampler
from recurrent_depth.model.layers import DiagonalInjection, RMSNorm, build_block, model_norm
from recurrent_depth.model.mixers import MixerContext, build_mixer, check_mixer_name
from recurrent_depth.model.mixers.attention import Attention
from recurrent_depth.model.mixers.base import check_config_options
from recurrent_depth.model.replay import DepthReplay, replay_core

NumSteps = int | tuple[int, int] | None
# Said after a depth past a model's ceiling (`RecurrentDepthLM.max_depth`).
DEPTH_CEILING_HINT = ("(the depth ceiling, MAX_NUM_STEPS unless raised: set model.max_depth, or --max-depth, to "
                      "run deeper)")
# Mixers that take an arbitrary [B, 1, T, T] attention mask, so packed examples can be kept apart.
DOCUMENT_MASK_MIXERS = frozenset({"attention"})
# the fewest rows `predict(at=...)` runs the head over (see there); 32 x vocab float32 logits is a few MiB
HEAD_MIN_ROWS = 32


@dataclass
class RecurrentOutput:
    """What `RecurrentDepthLM.forward` returns.

    logits: [B, T, V] float32 ([N, V] with `logits_at`: its N positions'). latent_states: ln_f(s_r) [B, T, h] (as
    the reference).
    final_state: the raw s_r [B, T, h] (what warm starts reuse). all_states: the raw states
    s_0..s_r stacked to [r + 1, B, T, h] when asked for, else None. num_steps: (n, k) as run.
    attentions (with `output_attentions=True`): {layer key: softmax probabilities [B, H, T, T_past + T]}
    for every application of a softmax-attention layer (attention, mla, dsa: zero off its top-k keys; nsa:
    the gate-weighted sum of its branches' weights, rows summing to the gates), in the order they ran
    (("prelude", i), then ("core", j, step) step by step, then ("coda", c)); other mixers have no entry.
    """

    logits: Tensor
    latent_states: Tensor
    final_state: Tensor
    loss: Tensor | None = None
    all_states: Tensor | None = None
    num_steps: tuple[int, int] = (0, 0)
    attentions: dict[tuple, Tensor] | None = None


def takase_init_(module: nn.Module, std: float, linear_std: float) -> None:
    """One module's own weights as the Takase init sets them: a Linear at `linear_std` (bias zero), an
    embedding at `std` (both truncated at ±3 std), an RMSNorm at a gain of one; other modules are left alone."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=linear_std, a=-3 * linear_std, b=3 * linear_std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
    elif isinstance(module, RMSNorm):
        module.reset_gain()



def check_scale_has_a_draw(config: ModelConfig, scale: float) -> None:
    """A one-line ValueError for an init_scale a model whose s_0 is its embedding cannot honour: s_0 = e whatever
    the scale (`initial_state`), so a scale other than the config's own (the default) asked for a random s_0 the
    model never draws. 0 (no draw, a deterministic s_0) is what it does anyway: kept, as RL rollouts and replays
    pass it for every model."""
    if config.state_init == "embedding" and scale != 0 and scale != config.init_scale:
        raise ValueError(
            f"init_scale={scale!r} scales a random s_0, but this model starts from its embedding "
            "(state_init='embedding', Ouro's layout): s_0 = e whatever the scale; leave init_scale unset"
        )

class RecurrentDepthLM(nn.Module):
    """A recurrent-depth language model: prelude -> `num_steps` applications of one core block -> coda.

    Build it from a `ModelConfig` (`RecurrentDepthLM(ModelConfig.from_preset("tiny"))`) or load one with
    `from_pretrained`; `forward` returns a `RecurrentOutput`. The recurrence is in this module's docstring.
    """

    # The depth ceiling of every call on this model: forward's num_steps and each generation option that counts
    # core steps (`GenerationOptions.validate`). MAX_NUM_STEPS unless raised for deliberately deep runs (what
    # `--max-depth` does); an attribute, not a config field, so that no saved config can lift it.
    max_depth: int = MAX_NUM_STEPS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # (a dict or a path failed at `.validate` with an AttributeError)
        if not isinstance(config, ModelConfig):
            raise TypeError(f"RecurrentDepthLM takes a ModelConfig (ModelConfig.from_preset(name) or "
                            f"ModelConfig(...); a saved directory loads with RecurrentDepthLM.from_pretrained), "
                            f"got {type(config).__name__}")
        config.validate()
        self.config = config
        h = config.hidden_size
        options = dict(config.mixer_options)
        for part in MODEL_PARTS:  # a misspelled name first, before its options read as misplaced ones
            check_mixer_name(config.mixer_for(part), part)

        def blocks(part: str, count: int) -> nn.ModuleList:
            name = config.mixer_for(part)
            return nn.ModuleList(
                build_block(config, build_mixer(name, config, part, **options)) for _ in range(count)
            )

        adapters = {"concat": lambda: nn.Linear(2 * h, h, bias=config.bias), "diagonal": lambda: DiagonalInjection(h)}
        modules = dict(
            wte=nn.Embedding(config.vocab_size, h),
            prelude=blocks("prelude", config.prelude_layers),
            ln_prelude=model_norm(config) if config.prelude_norm else None,
            adapter=adapters[config.injection]() if config.injection in adapters else None,
            core_block=blocks("core", config.core_layers),
            coda_projection=nn.Linear(h, h, bias=config.bias) if config.coda_projection else None,
            coda=blocks("coda", config.coda_layers),
            ln_f=model_norm(config),
            exit_gate=nn.Linear(h, 1) if config.exit_gate else None,  # Ouro's early_exit_gate (with a bias)
        )
        self.transformer = nn.ModuleDict({name: module for name, module in modules.items() if module is not None})
        # config options only some mixers implement (qk_norm, rope_style, num_kv_heads, ...): each mixer class says
        # which it honours, and a set one that a layer's mixer would ignore is refused (`check_config_options`)
        parts = [part for part in MODEL_PARTS for _ in range(getattr(config, f"{part}_layers"))]
        check_config_options(config, [(part, config.mixer_for(part), block.attn)
                                      for part, block in zip(parts, blocks_of(self), strict=True)])
        for i in config.value_embeddings:
            attn = blocks_of(self)[i].attn
            if not isinstance(attn, Attention):
                raise ValueError(f"ModelConfig.value_embeddings holds layer {i}, whose mixer is not 'attention' "
                                 f"(the only one with value embeddings)")
            attn.add_value_embedding(config.vocab_size)
        # The one place each layer's own attention settings are set (the mixer reads them on every path): its
        # window (`attn.window`), its RoPE base (`attn.rope_base`); soft-capping is read from the config by the
        # mixer. Only the 'attention' mixer implements them (the others were refused above).
        for i, block in enumerate(blocks_of(self)):
            window = config.attention_windows[i] if config.attention_windows else None
            base = config.layer_rope_bases[i] if config.layer_rope_bases else None
            if type(block.attn) is not Attention:
                if window is not None:
                    raise ValueError(f"ModelConfig.attention_windows gives layer {i} a window of {window}, but its "
                                     f"mixer is not 'attention' (the only one that takes a per-layer window)")
                continue
            if config.attention_windows:
                if block.attn.window is not None:
                    raise ValueError(f"ModelConfig.attention_windows and mixer_options both set the window of layer "
                                     f"{i}: set windows in one place")
                block.attn.window = window
            if base is not None:
                block.attn.rope_base = float(base)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.emb_scale = math.sqrt(h) if config.embedding_scale else 1.0
        # Per-iteration activation checkpointing (set from outside, e.g. by the trainer).
        self.gradient_checkpointing = False
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Takase init: std = sqrt(2/(5h)) everywhere, output projections std / sqrt(2 L_eff);
        with muP (`mup_base_width`) the untied lm_head's std is further divided by sqrt(m).

        L_eff = P + C + R * mean_recurrence layers run at the mean depth (at least 1: a model with
        no prelude or coda and mean_recurrence 0 is legal); norms are ones, biases zero.
        Truncated at ±3 std, as the reference.
        """
        std = math.sqrt(2 / (5 * self.config.hidden_size))
        out_std = std / math.sqrt(2 * max(1, self.config.effective_expected_depth))
        for name, module in self.named_modules():
            takase_init_(module, std, out_std if name.endswith(("attn.proj", "mlp.proj")) else std)
        for name, param in self.named_parameters():
            if name.endswith(("qk_bias", "q_bias", "k_bias")):
                nn.init.zeros_(param)
        if self.config.injection == "diagonal":
            self.transformer.adapter.reset_parameters()  # decay 1/sqrt(5), B = I (Parcae's init)
        if self.config.mup_base_width is not None:
            # muP's output layer (Tensor Programs V, Table 3): init variance 1/fan_in^2, i.e. std times
            # 1/sqrt(m) beyond the 1/sqrt(fan_in) above (equal to the standard init at the base width).
            self.lm_head.weight.mul_(1 / math.sqrt(self.config.width_multiplier))
            # Input weights with a fixed fan-in (value embeddings and their gates): variance 1/fan_in, i.e. not
            # shrinking with width, so sqrt(m) times the Takase std (again the standard init at the base width).
            for name, param in self.named_parameters():
                if name.endswith(tuple(f"{module}.weight" for module in FIXED_FAN_IN_MODULES)):
                    param.mul_(math.sqrt(self.config.width_multiplier))
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    # ------------------------------------------------------------------ pieces (used by inference too)
    def make_context(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: ModelCache | None = None,
        row_columns: list[int] | None = None,
        document_ids: Tensor | None = None,
    ) -> MixerContext:
        """Positions and masks for one call; left padding shifts each row's positions to start at 0.

        document_ids: [B, T] for rows that pack several examples (SFT): a query attends only to
        earlier keys of its own document (block-diagonal causal mask). Positions are the caller's.

        row_columns: one new token per row (T = 1), row b's at column (= position) row_columns[b]
        of a cache whose rows have different lengths (the serving pool): keys [0, max + 1) are
        read and each row sees only its own columns.
        """
        B, T = input_ids.shape
        device = input_ids.device
        if row_columns is not None:
            cols = torch.tensor(row_columns, dtype=torch.long, device=device)
            L = max(row_columns) + 1
            key_valid = attn_mask = None
            if min(row_columns) != L - 1:  # rows of different lengths: hide each row's columns past its own
                key_valid = torch.arange(L, device=device)[None] <= cols[:, None]  # [B, L]
                attn_mask = key_valid[:, None, None, :]  # [B, 1, 1, L]
            return MixerContext(
                positions=cols[:, None], past_len=L - 1, key_valid=key_valid, attn_mask=attn_mask, cache=cache,
                rope_base=self.config.rope_base, max_seq_len=self.config.max_seq_len,
                rope_scaling=rope_scaling_key(self.config.rope_scaling), token_ids=input_ids,
                query_columns=cols[:, None],
            )
        past = cache.seq_len if cache is not None else 0
        key_valid = attention_mask.bool() if attention_mask is not None else None
        if key_valid is not None and bool(key_valid.all()):
            key_valid = None  # nothing padded: take the fast causal path
        if position_ids is None:
            if key_valid is not None:
                position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + T, device=device).expand(B, T)
        attn_mask = None
        if key_valid is not None or (past > 0 and T > 1):
            q_idx = torch.arange(past, past + T, device=device)[:, None]
            k_idx = torch.arange(past + T, device=device)[None, :]
            allowed = (k_idx <= q_idx)[None, None]  # [1, 1, T, past + T]
            if key_valid is not None:
                # A padded query attends to itself only, so no softmax row is empty (no NaN).
                allowed = (allowed & key_valid[:, None, None, :]) | (k_idx == q_idx)[None, None]
            attn_mask = allowed
        if document_ids is not None:
            same = document_ids[:, None, :, None] == document_ids[:, None, None, :]  # [B, 1, T, T]
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            attn_mask = same & causal if attn_mask is None else attn_mask & same
        return MixerContext(
            positions=position_ids, past_len=past, key_valid=key_valid, attn_mask=attn_mask,
            cache=cache, rope_base=self.config.rope_base, max_seq_len=self.config.max_seq_len,
            rope_scaling=rope_scaling_key(self.config.rope_scaling), token_ids=input_ids,
        )

    def embed(self, input_ids: Tensor, ctx: MixerContext, inputs_embeds: Tensor | None = None) -> Tensor:
        """The input injection e = prelude(wte(x) * sqrt(h)): [B, T] -> [B, T, h] (no sqrt(h) without
        `embedding_scale`; then ln_prelude with `prelude_norm`)."""
        x = self.transformer.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if self.config.transformers_rounding:  # (transformers' Gemma: the factor rounded to x's dtype first)
            x = x * torch.tensor(self.emb_scale, dtype=x.dtype, device=x.device)
        else:
            x = x * self.emb_scale
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, ctx, ("prelude", i))
        return self.transformer.ln_prelude(x) if self.config.prelude_norm else x

    def initial_state(
        self, e: Tensor, init_scale: float = 1.0, generator: torch.Generator | None = None
    ) -> Tensor:
        """s_0: i.i.d. truncated normal (±3 sigma), sigma = sqrt(2/(5h)) * init_scale, times sqrt(h).

        Like the reference, a plain normal draw is made first and then overwritten by the truncated
        draw (in e's dtype), so with the global RNG the stream of random numbers matches it exactly;
        init_scale = 0 gives zeros after the same draw. With `state_init="embedding"` (Ouro) s_0 is e
        itself and nothing is drawn.
        """
        if self.config.state_init == "embedding":
            return e
        s = torch.randn(e.shape, dtype=e.dtype, device=e.device, generator=generator)
        if init_scale == 0:
            return s.zero_()
        std = math.sqrt(2 / (5 * self.config.hidden_size)) * init_scale
        nn.init.trunc_normal_(s, std=std, a=-3 * std, b=3 * std, generator=generator)
        return s * math.sqrt(self.config.hidden_size)

    def inject(self, state: Tensor, e: Tensor) -> Tensor:
        """The core's input at one step (config.injection): adapter([s | e]), s + e, s, or Parcae's
        exp(-dt A) * s + dt * (B e) (`DiagonalInjection`)."""
        injection = self.config.injection
        if injection == "concat":
            return self.transformer.adapter(torch.cat([state, e], dim=-1))
        if injection == "diagonal":
            return self.transformer.adapter(state, e)
        return state + e if injection == "add" else state

    def core_step(self, state: Tensor, e: Tensor, step: int, ctx: MixerContext) -> Tensor:
        """One recurrence: s <- core(adapter(concat[s, e])) (see `inject`), then ln_f with `step_norm`.
        Returns the state [B, T, h] carried to the next step."""
        x = self.inject(state, e)
        for j, block in enumerate(self.transformer.core_block):
            x = block(x, ctx, ("core", j, step))
        return self.transformer.ln_f(x) if self.config.step_norm else x

    def latent(self, state: Tensor) -> Tensor:
        """What the coda reads from a state: ln_f(s) (Huginn), or s itself without `norm_before_coda`;
        then through Parcae's C with `coda_projection`."""
        x = self.transformer.ln_f(state) if self.config.norm_before_coda else state
        return self.transformer.coda_projection(x) if self.config.coda_projection else x

    def head(self, x: Tensor) -> Tensor:
        """Logits float32 from the coda's output: lm_head(ln_f(x)), or lm_head(x) without `final_norm`; then
        cap * tanh(logits / cap) with `final_logit_softcapping` (Gemma 2), in the model's dtype with
        `transformers_rounding` (as transformers caps them), else in float32."""
        logits = self.lm_head(self.transformer.ln_f(x) if self.config.final_norm else x)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits.float()
        if not self.config.transformers_rounding:
            logits = logits.float()
        return (torch.tanh(logits / cap) * cap).float()

    def exit_probability(self, state: Tensor) -> Tensor:
        """Ouro's per-step exit probability lambda = sigmoid(exit_gate(latent(s))) [B, T] float32."""
        if not self.config.exit_gate:
            raise ValueError("this model has no exit gate (ModelConfig.exit_gate is false)")
        return torch.sigmoid(self.transformer.exit_gate(self.latent(state)).squeeze(-1).float())

    def predict(self, latent: Tensor, ctx: MixerContext, at: Tensor | None = None) -> Tensor:
        """Logits from latents (`latent`): head(coda(latent)) -> [B, T, V] float32; with `at` (bool [B, T]) the
        head runs at those positions only -> [N, V] in `x[at]`'s order (the coda still runs at every position:
        its attention reads them all)."""
        x = latent
        for c, block in enumerate(self.transformer.coda):
            x = block(x, ctx, ("coda", c))
        if at is None:
            return self.head(x)
        rows = x.reshape(-1, x.shape[-1])
        kept = at.reshape(-1).nonzero()[:, 0]
        n = len(kept)
        if n < HEAD_MIN_ROWS:
            # CPU BLAS (MKL) multiplies few rows (under 16 in float32) by another kernel, whose values differ from
            # a larger GEMM's in the last bits: pad with other positions to HEAD_MIN_ROWS rows (or all of them),
            # so that a kept position's logits are bitwise those of the whole head
            extra = (~at).reshape(-1).nonzero()[: HEAD_MIN_ROWS - n, 0]
            return self.head(rows[torch.cat([kept, extra])])[:n]
        return self.head(rows[kept])

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        num_steps: NumSteps = None,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        input_states: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        init_scale: float | None = None,
        generator: torch.Generator | None = None,
        cache: ModelCache | None = None,
        output_all_states: bool = False,
        replay: DepthReplay | None = None,
        output_attentions: bool = False,
        logits_at: Tensor | None = None,
    ) -> RecurrentOutput:
        """Run prelude -> num_steps core steps -> coda on `input_ids` [B, T].

        attention_mask: [B, T_cached + T], 1 for real tokens, 0 for (left) padding.
        document_ids: [B, T] ids of the examples packed into each row: attention stays inside an
        example (pass `position_ids` restarting at each example too). Softmax attention only.
        input_states: s_0 [B, T, h] instead of a random draw. inputs_embeds: [B, T, h] used in place of
        wte(input_ids) (before the sqrt(h) scale; GradMem's memory tokens), input_ids still giving the
        positions' count and the token ids of value embeddings. labels: [B, T] unshifted (shifted
        here), -100 ignored. cache: a cache object (see model/cache.py) to read and extend.
        replay: run each position at the depth a generation recorded for it, under that generation's KV
        policy (`model/replay.py`, for RL); `num_steps` is then unused and `cache` must be None.
        output_attentions: also return every softmax-attention layer's weights (`RecurrentOutput.attentions`),
        computed as plain math instead of the fused kernel (same outputs up to rounding; memory T x S per head
        per layer application).
        logits_at: bool [B, T]: run the vocabulary head at these positions only, logits `[N, V]` in the order of
        `x[logits_at]` (a scorer reads a few positions' logits: no `[B, T, V]` tensor); the values are those of
        the whole head's (bitwise with MKL float32; see `predict`).
        """
        if logits_at is not None:
            self.check_logits_at(input_ids, logits_at, labels)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if replay is not None and (cache is not None or output_all_states or output_attentions):
            raise ValueError("replay= runs one teacher-forced pass: it takes no cache, no output_all_states and "
                             "no output_attentions")
        n_free, n_grad = (0, 0) if replay is not None else self.resolve_num_steps(num_steps, generator)
        self.check_inputs(input_ids, labels, attention_mask, input_states, cache, position_ids)
        if document_ids is not None:
            self.check_document_ids(input_ids, document_ids, cache)
        if inputs_embeds is not None:
            self.check_inputs_embeds(input_ids, inputs_embeds)
        scale = self.config.init_scale if init_scale is None else init_scale
        if not is_real(scale) or scale < 0:
            raise ValueError(f"init_scale={scale!r} is invalid: expected a finite number >= 0")
        check_scale_has_a_draw(self.config, scale)
        if input_ids.dtype not in (torch.int32, torch.int64):
            input_ids = input_ids.long()  # the embedding lookup takes int32/int64 only

        ctx = self.make_context(input_ids, attention_mask, position_ids, cache, document_ids=document_ids)
        if output_attentions:
            ctx.attentions = {}
        e = self.embed(input_ids, ctx, inputs_embeds)
        state = input_states.to(e.dtype) if input_states is not None else self.initial_state(e, scale, generator)
        states = [state] if output_all_states else None
        if replay is not None:
            state = replay_core(self, state, e, ctx, replay)

        if n_free:
            with torch.no_grad():
                for step in range(n_free):
                    state = self.core_step(state, e, step, ctx)
                    if states is not None:
                        states.append(state)
            state = state.detach()
        use_checkpoint = self.gradient_checkpointing and torch.is_grad_enabled() and cache is None
        for step in range(n_free, n_free + n_grad):
            if use_checkpoint:
                state = checkpoint(self.core_step, state, e, step, ctx, use_reentrant=False)
            else:
                state = self.core_step(state, e, step, ctx)
            if states is not None:
                states.append(state)

        latent = self.latent(state)
        logits = self.predict(latent, ctx, logits_at)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).long(), ignore_index=-100
            )
        return RecurrentOutput(
            logits=logits, latent_states=latent, final_state=state, loss=loss,
            all_states=torch.stack(states) if states is not None else None, num_steps=(n_free, n_grad),
            attentions=ctx.attentions,
        )

    def depth_sampler(self) -> DepthSampler:
        """The sampler behind `num_steps=None` in training mode: the paper's log-normal Poisson around
        `mean_recurrence`, gradients through the last `mean_backprop_depth` steps."""
        mean, k = self.config.mean_recurrence, self.config.mean_backprop_depth
        if mean < 1 or k < 1:
            raise ValueError(
                f"num_steps=None in training mode samples a depth around mean_recurrence={mean} with "
                f"mean_backprop_depth={k} steps under autograd; both must be >= 1 (or pass num_steps)"
            )
        return DepthSampler(mean_recurrence=mean, backprop_depth=k)

    # ------------------------------------------------------------------ input checks
    def resolve_num_steps(self, num_steps: NumSteps, generator: torch.Generator | None = None) -> tuple[int, int]:
        """-> (steps without gradient, steps with gradient)."""
        if num_steps is None:
            if self.training:  # the paper's depth draw, from the forward's generator (model/depth.py)
                return self.depth_sampler().sample_from(generator)
            return 0, self.config.mean_recurrence
        if isinstance(num_steps, (bool, Tensor)):
            raise ValueError(f"num_steps must be an int, a pair (no_grad_steps, grad_steps) or None; "
                             f"got {type(num_steps).__name__} (use int(t) for a tensor)")
        if isinstance(num_steps, int):
            if not 0 <= num_steps <= self.max_depth:  # (10**30 ran until interrupted, or overflowed a kernel)
                raise ValueError(f"num_steps={num_steps} is invalid: expected an integer in [0, {self.max_depth}] "
                                 f"{DEPTH_CEILING_HINT}")
            return 0, num_steps
        if (
            isinstance(num_steps, tuple | list)
            and len(num_steps) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in num_steps)
        ):
            if num_steps[0] + num_steps[1] > self.max_depth:
                raise ValueError(f"num_steps={num_steps!r} is invalid: {num_steps[0] + num_steps[1]} core steps in "
                                 f"all, expected at most {self.max_depth} {DEPTH_CEILING_HINT}")
            return int(num_steps[0]), int(num_steps[1])
        raise ValueError(
            f"num_steps={num_steps!r} is invalid: expected an int >= 0, a pair of ints >= 0 "
            "(no_grad_steps, grad_steps), or None"
        )

    @staticmethod
    def check_logits_at(input_ids: Tensor, logits_at: Tensor, labels: Tensor | None) -> None:
        if not isinstance(logits_at, Tensor) or logits_at.dtype != torch.bool:
            raise ValueError(f"logits_at must be a bool torch.Tensor [batch, seq_len], got "
                             f"{getattr(logits_at, 'dtype', type(logits_at).__name__)}")
        if tuple(logits_at.shape) != tuple(input_ids.shape):
            raise ValueError(f"logits_at has shape {tuple(logits_at.shape)}, expected input_ids' "
                             f"{tuple(input_ids.shape)}")
        if labels is not None:
            raise ValueError("logits_at takes no labels: the loss reads every position's logits")

    def check_inputs(
        self,
        input_ids: Tensor,
        labels: Tensor | None,
        attention_mask: Tensor | None,
        input_states: Tensor | None,
        cache: ModelCache | None,
        position_ids: Tensor | None = None,
    ) -> None:
        cfg = self.config
        for name, value in (("input_ids", input_ids), ("labels", labels), ("attention_mask", attention_mask),
                            ("input_states", input_states), ("position_ids", position_ids)):
            if value is not None and not isinstance(value, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [batch, seq_len>0], got {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
            bad = ((input_ids < 0) | (input_ids >= cfg.vocab_size)).nonzero()[0].tolist()
            raise ValueError(
                f"token id {int(input_ids[bad[0], bad[1]])} at (row {bad[0]}, position {bad[1]}) is outside "
                f"the vocabulary [0, {cfg.vocab_size})"
            )
        past = cache.seq_len if cache is not None else 0
        total = past + input_ids.shape[1]
        # given position_ids (checked below to lie under max_seq_len) bound the positions instead: a row of packed
        # examples (trl's padding-free batches) may be longer than any one of them
        if total > cfg.max_seq_len and (position_ids is None or cache is not None):
            raise ValueError(
                f"sequence length {total} (cached {past} + new {input_ids.shape[1]}) exceeds "
                f"max_seq_len={cfg.max_seq_len}"
            )
        B, T = input_ids.shape
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, total):
                raise ValueError(
                    f"attention_mask must have shape [batch, cached + new] = {(B, total)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            if attention_mask.is_complex() or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
        if labels is not None:
            if tuple(labels.shape) != (B, T):
                raise ValueError(f"labels must have the shape of input_ids {(B, T)}, got {tuple(labels.shape)}")
            if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
                raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
            valid = (labels == -100) | ((labels >= 0) & (labels < cfg.vocab_size))
            if not bool(valid.all()):
                raise ValueError(f"labels must be token ids in [0, {cfg.vocab_size}) or -100 (ignored)")
        if input_states is not None and tuple(input_states.shape) != (B, T, cfg.hidden_size):
            raise ValueError(
                f"input_states must have shape [batch, seq_len, hidden_size] = {(B, T, cfg.hidden_size)}, "
                f"got {tuple(input_states.shape)}"
            )
        if input_states is not None and not input_states.dtype.is_floating_point:
            raise ValueError(f"input_states must be a floating-point tensor, got dtype {input_states.dtype}")
        if position_ids is not None:
            if tuple(position_ids.shape) not in ((B, T), (1, T)):
                raise ValueError(
                    f"position_ids must have shape [batch, seq_len] = {(B, T)} (or [1, seq_len]), "
                    f"got {tuple(position_ids.shape)}"
                )
            if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool or position_ids.is_complex():
                raise ValueError(f"position_ids must hold integer positions, got dtype {position_ids.dtype}")
            lowest, highest = int(position_ids.min()), int(position_ids.max())
            if lowest < 0 or highest >= cfg.max_seq_len:
                raise ValueError(
                    f"position_ids must lie in [0, max_seq_len={cfg.max_seq_len}), got values in [{lowest}, {highest}]"
                )

    def check_inputs_embeds(self, input_ids: Tensor, inputs_embeds: Tensor) -> None:
        """inputs_embeds: a floating-point [B, T, h] tensor matching input_ids."""
        B, T = input_ids.shape
        expected = (B, T, self.config.hidden_size)
        if not isinstance(inputs_embeds, Tensor) or tuple(inputs_embeds.shape) != expected:
            shape = tuple(inputs_embeds.shape) if isinstance(inputs_embeds, Tensor) else type(inputs_embeds).__name__
            raise ValueError(f"inputs_embeds must have shape [batch, seq_len, hidden_size] = {expected}, got {shape}")
        if not inputs_embeds.dtype.is_floating_point:
            raise ValueError(f"inputs_embeds must be a floating-point tensor, got dtype {inputs_embeds.dtype}")

    def check_document_ids(self, input_ids: Tensor, document_ids: Tensor, cache: ModelCache | None) -> None:
        """Packed rows need a [B, T] integer tensor, no cache, and a mixer that takes a block-diagonal mask."""
        if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != tuple(input_ids.shape):
            shape = tuple(document_ids.shape) if isinstance(document_ids, Tensor) else type(document_ids).__name__
            raise ValueError(f"document_ids must be a tensor of the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {shape}")
        if document_ids.dtype.is_floating_point or document_ids.is_complex():
            raise ValueError(f"document_ids must hold integer ids, got dtype {document_ids.dtype}")
        if cache is not None:
            raise ValueError("document_ids (packed examples) is for a parallel forward, not with a cache")
        for part in MODEL_PARTS:
            mixer = self.config.mixer_for(part)
            if mixer not in DOCUMENT_MASK_MIXERS:
                raise ValueError(f"document_ids (packed examples) needs softmax attention, but the {part} uses "
                                 f"mixer {mixer!r}, which cannot keep packed examples apart: put one example per "
                                 f"row instead (rdepth sft --no-packing)")

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: Any, **kwargs: Any) -> None:
        """Write config.json and safetensors weights to the directory `path` (and a tokenizer when given);
        keywords as `recurrent_depth.checkpoint.save_pretrained`."""
        save_pretrained(self, path, **kwargs)

    @classmethod
    def from_pretrained(
        cls, path: Any, dtype: torch.dtype | str | None = None, device: Any = "cpu", **kwargs: Any
    ) -> RecurrentDepthLM:
        """Load a directory written by `save_pretrained` or an official Huginn-0125 (Ouro, Parcae) one, in the
        stored dtype unless `dtype` is given; other keywords as `recurrent_depth.checkpoint.load_pretrained`."""
        return load_pretrained(path, dtype=dtype, device=device, model_class=cls, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def library_model(model: Any) -> Any:
    """`model` as the library's functions take it: a transformers wrapper (`integrations.hf`'s classes, or peft's
    around one) gives the `RecurrentDepthLM` it holds (its `core`, sharing every weight, adapters included);
    anything else is returned as it is (a `RecurrentDepthLM`, or peft's wrapper of one)."""
    core = getattr(model, "core", None)
    return core if isinstance(core, RecurrentDepthLM) else model


def blocks_of(model: RecurrentDepthLM) -> list[nn.Module]:
    """The model's blocks in order: prelude, core, coda."""
    return [*model.transformer.prelude, *model.transformer.core_block, *model.transformer.coda]


def mixers_with(model: RecurrentDepthLM, flag: str) -> list[str]:
    """The names of `model`'s mixers that set `flag` (`shared_counter`, `absolute_positions`: see
    `model.mixers.common.RecurrentMixer`), sorted, each once."""
    return sorted({b.attn.mixer_name for b in blocks_of(model) if getattr(b.attn, flag, False)})


def all_attention(model: RecurrentDepthLM) -> bool:
    """Every block mixes tokens with softmax attention (what cache lookups that hide columns need)."""
    return all(type(b.attn) is Attention for b in blocks_of(model))
