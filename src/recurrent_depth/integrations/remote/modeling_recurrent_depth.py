"""A recurrent-depth language model for `trust_remote_code=True`, in one file (torch + transformers only).

Written next to a saved model by `rdepth export --remote-code`, so the directory loads in a plain
transformers >= 5 environment without the `recurrent_depth` library:

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    model(input_ids, num_steps=16).logits        # or num_steps=(12, 4): 12 steps without gradients, then 4 with
    model.generate(input_ids, max_new_tokens=32, num_steps=16)
    scorer = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True, num_labels=1)

The architecture (Huginn-0125's):

    e    = prelude(wte(x) * sqrt(h))                     input injection, computed once
    s_0  ~ TruncNormal(0, sigma^2, +-3 sigma) * sqrt(h)  sigma = sqrt(2 / (5h)) * init_scale
    s_i  = core(adapter(concat[s_{i-1}, e]))             i = 1..r, the same weights every step
    p    = lm_head(ln_f(coda(ln_f(s_r))))                logits in float32

Training (transformers' Trainer, trl) calls the model without num_steps: in training mode the depth is then drawn
as the library and the paper draw it, by `config.depth_scheme` ("poisson-lognormal", the default: Poisson(exp(tau))
+ 1 around mean_recurrence; "fixed": mean_recurrence; "uniform"), with gradients through the last
mean_backprop_depth steps only. `from_pretrained(path, trust_remote_code=True, depth_scheme="fixed",
init_scale=0.0)` makes a training-mode forward the eval forward; depth_scheme is not written to config.json.

This file covers inference at a given depth and training with softmax attention (grouped-query
attention and sliding windows, per layer or for all, included); per-token early exit, KV-cache sharing,
warm starts and the other token mixers need the `recurrent_depth` library, which registers its own classes and
takes precedence over this file whenever it is imported. Asked for those options, `generate` and
`forward` say so in one line (`LIBRARY_ONLY_OPTIONS`) instead of transformers' "model_kwargs are
not used" (a second copy of the library's decoding loops here would be a second implementation to
keep exact).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# The Trainer shifts the labels for `label_smoothing_factor` only for causal LMs named in this table.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("recurrent_depth", "RecurrentDepthForCausalLM")

# The library's architecture fields at Huginn's values (recurrent_depth.config.HUGINN_ARCHITECTURE).
HUGINN_ARCHITECTURE = dict(
    block_layout="sandwich", rope_style="interleaved", rope_scaling=None, qkv_bias=False, qk_norm_full_width=False,
    mlp_activation="silu", embedding_scale=True, norm_before_coda=True, final_norm=True, step_norm=False,
    injection="concat", state_init="random", exit_gate=False, mlp_gated=True, qk_norm_eps=None, prelude_norm=False,
    coda_projection=False, value_embeddings=[], attn_logit_softcapping=None, final_logit_softcapping=None,
    layer_rope_bases=[], transformers_rounding=False, norm_unit_offset=False, norm_float32_gain=False,
    eager_attention=False,
)

# Options of the library's `generate` (and the official code's names for them) that this file does not
# implement: refused by name rather than dropped (tests/test_hf_export.py keeps the list equal to the
# library's options schema). `output_logits` is not here: it is transformers' own generate flag too.
LIBRARY_ONLY_OPTIONS = (
    "exit_criterion", "exit_threshold", "exit_kv", "min_steps", "max_steps", "warm_start", "warm_start_source",
    "exit_in_prefill", "min_steps_rule", "check_every", "kv_budget", "kv_policy", "kv_quant", "cache_implementation",
    "draft_steps", "lookahead", "verification_threshold", "sampler", "inner_steps", "headway", "wavefront",
    "max_wavefront", "seed", "stop", "fast", "finish_round", "defaults",
    "criterion", "cache_lookup_strategy", "continuous_compute", "do_not_exit_in_prefill",
    "check_criterion_every_n_steps", "lookahead_for_draft", "cache_kwargs",
    "gradmem_tokens", "gradmem_steps", "gradmem_lr", "gradmem_depth", "gradmem_init", "gradmem_query_tokens",
    "ttt_params", "ttt_steps", "ttt_lr", "ttt_optimizer", "ttt_depth", "ttt_backprop",
)

# forward() keyword arguments transformers may send that carry nothing this model reads (generate(...,
# stop_strings=, tokenizer=) passes the tokenizer on with the model kwargs); any other unknown one is refused, so a
# misspelt option (num_step=) is not silently ignored.
IGNORED_FORWARD_KWARGS = ("cache_position", "token_type_ids", "tokenizer")

# The longest sliding window (recurrent_depth.config.MAX_SEQ_LEN, the longest context): a larger one overflows the
# mask's int64 positions.
MAX_WINDOW = 2**31 - 1


# A training-mode forward given no num_steps (transformers' Trainer, trl) draws its depth by `config.depth_scheme`, as
# the library does (recurrent_depth.model.depth; tests/test_remote_training.py keeps the two draws equal).
DEPTH_SCHEMES = ("poisson-lognormal", "fixed", "uniform")
DEFAULT_DEPTH_SCHEME = "poisson-lognormal"
DEPTH_SIGMA = 0.5  # the paper's spread of the log-normal (DepthSampler.sigma)


def check_depth_scheme(value: Any) -> str:
    """`value` if it names a depth scheme, else one ValueError line (the library's words)."""
    if value not in DEPTH_SCHEMES:
        raise ValueError(f"config.depth_scheme={value!r} is invalid: expected one of {', '.join(DEPTH_SCHEMES)}")
    return value


def training_depth(config: Any, generator: torch.Generator | None) -> tuple[int, int]:
    """(no-grad steps, grad steps) of a training-mode forward given no num_steps, drawn from `generator` (None: the
    global RNG) as the library's `DepthSampler(mean_recurrence, mean_backprop_depth, scheme=...).sample_from`:

        poisson-lognormal  r = Poisson(exp(tau)) + 1,  tau ~ Normal(ln(r_bar) - sigma^2 / 2, sigma)   (the paper's)
        fixed              r = r_bar
        uniform            r ~ Uniform{1, ..., 2 r_bar - 1}

    and gradients through the last mean_backprop_depth (k) steps only: (max(r - k, 0), min(r, k))."""
    scheme = check_depth_scheme(getattr(config, "depth_scheme", DEFAULT_DEPTH_SCHEME))
    mean, k = config.mean_recurrence, config.mean_backprop_depth
    if mean < 1 or k < 1:
        raise ValueError(f"num_steps=None in training mode samples a depth around mean_recurrence={mean} with "
                         f"mean_backprop_depth={k} steps under autograd; both must be >= 1 (or pass num_steps)")
    device = generator.device if generator is not None else torch.device("cpu")
    if scheme == "fixed":
        r = int(mean)
    elif scheme == "uniform":
        r = int(torch.randint(1, 2 * int(mean), (), generator=generator, device=device))
    else:  # mu = ln(r_bar) - sigma^2 / 2 makes E[exp(tau)] = r_bar
        mu = math.log(mean) - 0.5 * DEPTH_SIGMA**2
        tau = mu + DEPTH_SIGMA * torch.randn((), generator=generator, dtype=torch.float64, device=device)
        r = int(torch.poisson(tau.exp(), generator=generator)) + 1
    return max(r - k, 0), min(r, k)


def resolve_num_steps(num_steps: Any, mean_recurrence: int) -> tuple[int, int]:
    """(steps run without autograd, steps in all) of a forward's `num_steps`, as the library reads it: None ->
    mean_recurrence; an int n -> n steps, all under autograd; a pair (n, k) (a list too: a GenerationConfig saved
    to JSON reads a tuple back as one) -> n steps without autograd, then k with (truncated backprop, the official
    checkpoint's convention). The logits are those of n + k steps either way."""
    if num_steps is None:  # (the config's value, from config.json or a from_pretrained keyword: checked too)
        if isinstance(mean_recurrence, int) and not isinstance(mean_recurrence, bool) and mean_recurrence >= 0:
            return 0, mean_recurrence
        raise ValueError(f"config.mean_recurrence={mean_recurrence!r} (the depth of num_steps=None) is invalid: "
                         "expected an integer >= 0")
    if isinstance(num_steps, int) and not isinstance(num_steps, bool) and num_steps >= 0:
        return 0, num_steps
    if isinstance(num_steps, tuple | list) and len(num_steps) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in num_steps):
        return int(num_steps[0]), int(num_steps[0]) + int(num_steps[1])
    raise ValueError(f"num_steps={num_steps!r} is invalid: expected None, an integer >= 0 or a pair of integers "
                     ">= 0 (no_grad_steps, grad_steps)")


def is_window(value: Any) -> bool:
    """An integer sliding window in [1, MAX_WINDOW] (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_WINDOW


def is_integer_tensor(value: Tensor) -> bool:
    """Integer dtype: not floating point, bool or complex (the library's test for ids and labels)."""
    return not (value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex())


def check_ids(input_ids: Any, vocab_size: int) -> None:
    """One ValueError line for ids that are not integers, an empty prompt or an id outside the vocabulary (not an
    IndexError or a RuntimeError from deep inside the embedding), as the library says it."""
    if not isinstance(input_ids, Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if not is_integer_tensor(input_ids):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape [batch, seq_len>0], got {tuple(input_ids.shape)}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        bad = ((input_ids < 0) | (input_ids >= vocab_size)).nonzero()[0].tolist()
        raise ValueError(f"token id {int(input_ids[bad[0], bad[1]])} at (row {bad[0]}, position {bad[1]}) is "
                         f"outside the vocabulary [0, {vocab_size})")


def check_mask_and_labels(input_ids: Tensor, attention_mask: Any, labels: Any, past: int, vocab_size: int) -> None:
    """attention_mask [batch, cached + new] of 0s and 1s, labels [batch, seq_len] of token ids or -100, in the
    library's words: a mask of another length was a broadcast RuntimeError (or, all ones, silently dropped), one
    holding document ids (2, 3, ...) attended across documents, a label outside the vocabulary an IndexError."""
    B, T = input_ids.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (B, past + T):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must have shape [batch, cached + new] = {(B, past + T)}, got {got}")
        if attention_mask.is_complex() or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
    if labels is not None:
        if not isinstance(labels, Tensor) or tuple(labels.shape) != (B, T):
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"labels must have the shape of input_ids {(B, T)}, got {got}")
        if not is_integer_tensor(labels):
            raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
        if not bool(((labels == -100) | ((labels >= 0) & (labels < vocab_size))).all()):
            raise ValueError(f"labels must be token ids in [0, {vocab_size}) or -100 (ignored)")


# the fewest rows `head_at` runs the vocabulary head over (as the library's `RecurrentDepthLM.predict`)
HEAD_MIN_ROWS = 32


def kept_positions(logits_to_keep: Any, seq_len: int) -> tuple[Tensor, Tensor] | None:
    """transformers' `logits_to_keep` over `seq_len` positions: None for all of them, else (`columns`: the sorted
    distinct positions it names, `order`: each kept logit's index into `columns`), so that the kept logits are
    `logits[:, columns][:, order]`. An int n keeps the last n positions (0: all of them), a 1-D tensor the positions
    it lists, as `logits[:, tensor]` reads them (negative: from the end; repeats and any order; bool: a mask)."""
    if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep >= 0:
        if logits_to_keep == 0 or logits_to_keep >= seq_len:
            return None
        return torch.arange(seq_len - logits_to_keep, seq_len), torch.arange(logits_to_keep)
    if (isinstance(logits_to_keep, Tensor) and logits_to_keep.dim() == 1 and not logits_to_keep.is_floating_point()
            and not logits_to_keep.is_complex()):
        positions = logits_to_keep.cpu()
        if positions.dtype == torch.bool:
            if len(positions) != seq_len:
                raise ValueError(f"logits_to_keep is a bool mask of {len(positions)} positions, expected seq_len="
                                 f"{seq_len}")
            positions = positions.nonzero()[:, 0]
        elif bool(((positions < -seq_len) | (positions >= seq_len)).any()):
            raise ValueError(f"logits_to_keep lists positions outside [-{seq_len}, {seq_len}) (seq_len={seq_len})")
        columns, order = torch.unique(positions.long() % seq_len, sorted=True, return_inverse=True)
        return columns, order
    raise ValueError(f"logits_to_keep={logits_to_keep!r} is invalid: expected an integer >= 0 (the last positions "
                     "to keep, 0: all) or a 1-D tensor of positions")


def kept_logits(logits: Tensor, logits_to_keep: Any) -> Tensor:
    """The logits [B, T, V] at transformers' `logits_to_keep` (`kept_positions`): [B, kept, V]."""
    kept = kept_positions(logits_to_keep, logits.shape[1])
    return logits if kept is None else logits[:, kept[0].to(logits.device)][:, kept[1].to(logits.device)]


def head_at(head: Any, hidden: Tensor, columns: Tensor) -> Tensor:
    """`head(hidden)[:, columns]` [B, len(columns), V] without the [B, T, V] tensor: the head runs at those positions
    only. CPU BLAS (MKL) multiplies few rows (under 16 in float32) by another kernel, whose values differ from a
    larger GEMM's in the last bits: so it runs over HEAD_MIN_ROWS rows at least (or all of them), padded with other
    positions, and a kept position's logits are bitwise those of the whole head."""
    B, T, h = hidden.shape
    at = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    at[:, columns.to(hidden.device)] = True
    rows = hidden.reshape(-1, h)
    kept = at.reshape(-1).nonzero()[:, 0]  # (batch, position) order: the result reshapes to [B, len(columns), V]
    extra = (~at).reshape(-1).nonzero()[: max(HEAD_MIN_ROWS - len(kept), 0), 0]
    logits = head(rows[torch.cat([kept, extra])])[: len(kept)]
    return logits.reshape(B, len(columns), logits.shape[-1])


# generate refuses input_states up front: a forward's s_0 for the positions of that one call, it does not fit the
# decoding steps' new positions (the library's generate says the same: integrations/hf.py imports this).
INPUT_STATES_IN_GENERATE = (
    "generate: input_states is a forward() argument (s_0 for each position of that one call) and generate does not "
    "take it: set generate's s_0 with init_scale= (0: s_0 = 0), or call the model with input_states= to score a "
    "sequence from given states")

# transformers' DoLa (hub code once trust_remote_code=True) reads hidden_states as per-layer outputs and applies the
# lm_head to each: here they are the recurrent states s_0..s_r, which the coda reads before the head (and fewer than
# num_hidden_layers at low depth), so its early-layer logits would be meaningless (integrations/hf.py imports this).
DOLA_IN_GENERATE = (
    "generate: dola_layers (DoLa decoding) contrasts the logits of early layers, which a recurrent-depth model does "
    "not have: its hidden_states are the recurrent states s_0..s_r, which the coda reads before the lm_head")


# forward() options that generate passes as model kwargs: what any other forward of the same call must run with
GENERATE_FORWARD_OPTIONS = ("num_steps", "init_scale", "generator")


def bind_forward_options(processors: Any, model_kwargs: dict[str, Any] | None, names: tuple[str, ...]) -> None:
    """Give classifier-free guidance's processor (`guidance_scale`, the one transformers processor that runs the model
    itself) the call's forward options `names` found in `model_kwargs`: it called the model without them, so its
    unconditional logits ran at config.mean_recurrence and the config's init_scale, not the call's."""
    from functools import partial

    from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

    bound = {name: model_kwargs[name] for name in names if (model_kwargs or {}).get(name) is not None}
    for processor in processors:
        if bound and isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            processor.model = partial(processor.model, **bound)


def drop_unread_options(candidate_generator: Any, names: tuple[str, ...]) -> Any:
    """An assisted-decoding candidate generator whose assistant (`assistant_model=`) is not given the options `names`
    its forward does not take: transformers hands the assistant a copy of the call's model kwargs, so an assistant of
    another architecture (a small Llama, GPT-2) failed with "model_kwargs are not used by the model: ['num_steps']".
    The drafts only set the speed: the model verifies them at the call's options."""
    import inspect

    assistant = getattr(candidate_generator, "assistant_model", None)
    kwargs = getattr(candidate_generator, "assistant_kwargs", None)
    if assistant is not None and isinstance(kwargs, dict):
        takes = inspect.signature(type(assistant).forward).parameters
        for name in names:
            if name not in takes:
                kwargs.pop(name, None)
    return candidate_generator


def refuse_library_only(kwargs: dict[str, Any]) -> None:
    """One line naming the options this file cannot run, why, and how to get them."""
    if kwargs.get("input_states") is not None:  # (transformers' loop used them for the prompt, then failed)
        raise ValueError(INPUT_STATES_IN_GENERATE)
    asked = sorted(k for k in kwargs if k in LIBRARY_ONLY_OPTIONS and kwargs[k] is not None)
    if not asked:
        return
    reasons = []
    depth = [k for k in asked if k != "cache_implementation"]
    if depth:
        reasons.append(f"{', '.join(depth)}: this exported model (trust_remote_code) runs at a fixed depth only "
                       "(num_steps, init_scale); per-token exit, KV sharing, warm start, speculative and parallel "
                       "decoding need the recurrent_depth library")
    if "cache_implementation" in asked:
        reasons.append("cache_implementation: this exported model keeps its keys and values in its own dynamic cache "
                       "(one cache layer per layer and core step, which transformers' static caches do not hold); "
                       "the preallocated static cache needs the recurrent_depth library")
    raise ValueError(
        f"{'; '.join(reasons)}: pip install recurrent-depth and `import recurrent_depth` before from_pretrained "
        "(its classes then take precedence over this file), or `rdepth generate --model DIR`"
    )


class RecurrentDepthConfig(PretrainedConfig):
    model_type = "recurrent_depth"
    attribute_map = {
        "max_position_embeddings": "max_seq_len",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 176
    prelude_layers: int = 1
    core_layers: int = 2
    coda_layers: int = 1
    mean_recurrence: int = 4
    mean_backprop_depth: int = 2
    max_seq_len: int = 256
    rope_base: float = 50_000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    qk_norm: bool = False
    qk_norm_per_head: bool = False
    bias: bool = False
    tie_embeddings: bool = True
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mixer: Any = "attention"
    mixer_options: Any = None
    attention_windows: Any = None  # one window per layer (prelude, core, coda; null = full attention), or []
    # a field, so transformers writes it back as is (not as its own `rope_parameters`, which the library refuses)
    rope_scaling: Any = None
    use_cache: bool = True
    # Training mode without num_steps (see `training_depth`): a runtime setting, as the library's, not in config.json.
    depth_scheme: str = DEFAULT_DEPTH_SCHEME

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        check_depth_scheme(self.depth_scheme)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.mixer_options is None:
            self.mixer_options = {}
        mixers = set(self.mixer.values()) if isinstance(self.mixer, dict) else {self.mixer}
        if mixers - {"attention"} or set(self.mixer_options) - {"window"}:
            raise ValueError(
                f"this file implements softmax attention only (mixer_options: window); got mixer={self.mixer!r}, "
                f"mixer_options={self.mixer_options!r}. Install recurrent_depth to run this model."
            )
        # Architecture keys of the library's other model families (Ouro, retrofitted transformers): this file
        # implements their Huginn values only, so a config asking for another is refused, not run wrongly.
        for key, huginn in HUGINN_ARCHITECTURE.items():
            value = getattr(self, key, huginn)
            if value != huginn:
                raise ValueError(f"this file implements Huginn's architecture only; config.json sets {key}={value!r}. "
                                 "Install recurrent_depth to run this model.")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError("num_kv_heads must divide num_heads and head_dim must be even")
        windows = [] if self.attention_windows is None else self.attention_windows
        n = self.prelude_layers + self.core_layers + self.coda_layers
        if not isinstance(windows, list) or (windows and len(windows) != n) or not all(
                w is None or is_window(w) for w in windows):
            raise ValueError(f"attention_windows={windows!r} is invalid: expected [] or {n} entries (prelude, core, "
                             f"coda layers in order), each null (full attention) or an integer window in "
                             f"[1, {MAX_WINDOW}]")
        if self.mixer_options.get("window") is not None and not is_window(self.mixer_options["window"]):
            raise ValueError(f"mixer_options window={self.mixer_options['window']!r} is invalid: expected null or an "
                             f"integer in [1, {MAX_WINDOW}]")
        if windows and self.mixer_options.get("window") is not None:
            raise ValueError("attention_windows and mixer_options both set windows: set windows in one place")
        self.attention_windows = windows

    @property
    def num_hidden_layers(self) -> int:
        return self.prelude_layers + self.core_layers + self.coda_layers

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers applies `from_pretrained(..., depth_scheme=...)` after `__post_init__`: checked again."""
        out = super().from_dict(config_dict, **kwargs)
        check_depth_scheme((out[0] if isinstance(out, tuple) else out).depth_scheme)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("depth_scheme", None)  # (a runtime setting: not saved)
        return out


def rope_table(head_dim: int, max_len: int, base: float, device: torch.device) -> Tensor:
    """(cos, sin) of pos * base^(-2i/d) for interleaved pairs: [max_len, head_dim/2, 2], float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs of x [B, T, H, D] by the angles in cos, sin [B, T, 1, D/2], in float32: one complex
    product per pair, (a + ib)(cos + i sin), as the library computes it (real arithmetic rounds differently: a
    bfloat16 / float16 export's logits then differed from the library's by a unit in the last place); under
    torch.compile, which cannot fuse complex numbers, the same formula in real arithmetic, as the library."""
    pairs = x.float().unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling():
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)
    if pairs.stride(-1) != 1 or any(stride % 2 for stride in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # view_as_complex needs (real, imag) adjacent and aligned
    return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, heads: int | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) if heads is None else torch.ones(heads, dim))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class GatedMLP(nn.Module):
    def __init__(self, config: RecurrentDepthConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.proj.is_output_projection = True

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class Context:
    """Per-call facts every layer reads: positions [B, T], the boolean mask or None, the cache, and with a padded
    mask each key's position [B, past + T] (real tokens counted, as RoPE counts them; None: the column)."""

    def __init__(self, positions: Tensor, past: int, mask: Tensor | None, cache: Any, config: Any,
                 key_positions: Tensor | None = None) -> None:
        self.positions, self.past, self.mask, self.cache = positions, past, mask, cache
        self.key_positions = key_positions
        self.attentions: list[Tensor] | None = None  # output_attentions: each attention call's weights, in order
        table = rope_table(config.head_dim, config.max_seq_len, config.rope_base, positions.device)
        picked = table[positions]  # [B, T, D/2, 2]
        self.cos, self.sin = picked[..., 0].unsqueeze(2), picked[..., 1].unsqueeze(2)


class Attention(nn.Module):
    def __init__(self, config: RecurrentDepthConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        # layer: 0-based over prelude, core, coda; its own window (attention_windows) or every layer's (mixer_options)
        windows = getattr(config, "attention_windows", None) or []
        self.window = windows[layer] if windows else (config.mixer_options or {}).get("window")
        self.Wqkv = nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.bias
        )
        self.proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.bias)
        self.proj.is_output_projection = True
        self.has_qk_bias = config.qk_bias
        if config.qk_bias:
            if self.num_kv_heads == self.num_heads:
                self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
            else:
                self.q_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
                self.k_bias = nn.Parameter(torch.zeros(self.num_kv_heads, self.head_dim))
        self.qk_norm = getattr(config, "qk_norm", False)
        if self.qk_norm:  # per-head RMSNorm of q and k, one gain [head_dim] (or one per head), before RoPE
            per_head = getattr(config, "qk_norm_per_head", False)
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps, self.num_heads if per_head else None)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps, self.num_kv_heads if per_head else None)

    def forward(self, x: Tensor, ctx: Context, layer_key: tuple) -> Tensor:
        B, T, _ = x.shape
        D, H, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.Wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if self.has_qk_bias:
            if Hkv == H:
                q, k = q + self.qk_bias[0], k + self.qk_bias[1]
            else:
                q, k = q + self.q_bias, k + self.k_bias
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            k, v = ctx.cache.update_kv(layer_key, k, v)  # [B, past + T, Hkv, D]
        mask = ctx.mask
        is_causal = mask is None and ctx.past == 0 and T > 1
        if self.window is not None:
            q_idx = torch.arange(ctx.past, ctx.past + T, device=x.device)[:, None]
            k_idx = torch.arange(k.shape[1], device=x.device)[None, :]
            if ctx.key_positions is None:
                allowed = ((k_idx <= q_idx) & (k_idx > q_idx - self.window))[None, None]
            else:  # the last `window` real tokens, as the library counts them: a masked column inside a row (a pad
                # id in the prompt, transformers' inferred mask) is not one of them (by columns, it was)
                pos = ctx.key_positions
                recent = pos[:, ctx.past:, None] - pos[:, None, :] < self.window  # [B, T, past + T]
                allowed = (k_idx <= q_idx)[None, None] & recent[:, None]
            mask = allowed if mask is None else mask & allowed
            is_causal = False
        if ctx.attentions is not None:  # output_attentions: the same attention as plain math, weights kept
            qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if Hkv != H:  # query head h reads key head h // (H / Hkv), as SDPA's enable_gqa
                kh, vh = kh.repeat_interleave(H // Hkv, dim=1), vh.repeat_interleave(H // Hkv, dim=1)
            wide = torch.float64 if qh.dtype == torch.float64 else torch.float32  # (a float64 model stays float64)
            logits = torch.matmul(qh.to(wide), kh.to(wide).transpose(-1, -2)) / math.sqrt(D)  # [B, H, T, S]
            if is_causal:
                mask = torch.ones(T, kh.shape[2], dtype=torch.bool, device=x.device).tril()
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(logits, dim=-1).to(vh.dtype)
            ctx.attentions.append(probs)
            out = torch.matmul(probs, vh)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=is_causal, enable_gqa=Hkv != H,
            )
        return self.proj(out.transpose(1, 2).reshape(B, T, H * D))


class SandwichBlock(nn.Module):
    def __init__(self, config: RecurrentDepthConfig, layer: int = 0) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_eps
        self.norm_1 = RMSNorm(h, eps)
        self.attn = Attention(config, layer)
        self.norm_2 = RMSNorm(h, eps)
        self.mlp = GatedMLP(config)
        self.norm_3 = RMSNorm(h, eps)
        self.norm_4 = RMSNorm(h, eps)

    def forward(self, x: Tensor, ctx: Context, layer_key: tuple) -> Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), ctx, layer_key))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class RecurrentDepthCache(DynamicCache):
    """One transformers cache layer per (layer, step).

    prelude layer i -> i, coda layer c -> P + c, core layer j at step t -> P + C + t * R + j.
    """

    def __init__(self, config: RecurrentDepthConfig) -> None:
        super().__init__()
        self.P, self.R, self.C = config.prelude_layers, config.core_layers, config.coda_layers
        self.seen = 0

    def update_kv(self, key: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        part = key[0]
        idx = key[1] if part == "prelude" else self.P + key[1] if part == "coda" else (
            self.P + self.C + key[2] * self.R + key[1]
        )
        while len(self.layers) <= idx:
            self.layers.append(self.layer_class_to_replicate())
        if self.seen and self.layers[idx].get_seq_length() and self.layers[idx].keys.shape[0] != k.shape[0]:
            raise ValueError(f"the cache holds {self.layers[idx].keys.shape[0]} rows but this call has {k.shape[0]}: "
                             "a cache continues the batch that filled it (a beam search's holds batch x num_beams "
                             "rows, and num_return_sequences' batch x that many)")
        if self.layers[idx].get_seq_length() != self.seen:
            raise RuntimeError(f"cache layer {key} is out of step with the {self.seen} cached tokens")
        keys, values = self.layers[idx].update(k.transpose(1, 2), v.transpose(1, 2))
        return keys.transpose(1, 2), values.transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            tokens_to_remove -= self.seen
        if tokens_to_remove:
            super().crop(tokens_to_remove)
            self.seen += tokens_to_remove


class RecurrentDepthForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = RecurrentDepthConfig
    base_model_prefix = "transformer"
    _supports_sdpa = True  # attention runs through F.scaled_dot_product_attention (plain math for output_attentions)
    supports_gradient_checkpointing = True  # per core step, as the library's model (see forward)
    _no_split_modules = ["SandwichBlock"]
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _keys_to_ignore_on_load_unexpected = [r"^freqs_cis$"]

    def __init__(self, config: RecurrentDepthConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        P, R = config.prelude_layers, config.core_layers  # (layer indices for each block's window)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, h),
                prelude=nn.ModuleList(SandwichBlock(config, i) for i in range(P)),
                adapter=nn.Linear(2 * h, h, bias=config.bias),
                core_block=nn.ModuleList(SandwichBlock(config, P + j) for j in range(R)),
                coda=nn.ModuleList(SandwichBlock(config, P + R + c) for c in range(config.coda_layers)),
                ln_f=RMSNorm(h, config.norm_eps),
            )
        )
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.emb_scale = math.sqrt(h)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable (with _gradient_checkpointing_func)
        self.post_init()

    def _untied_head(self) -> bool:
        """Whether the config ties the head to the embedding but the lm_head holds other values (peft's
        merge_and_unload of an adapter with modules_to_save=["lm_head"]): save_pretrained then saves it untied, as a
        tied config beside two different tensors does not load."""
        head = getattr(getattr(self, "lm_head", None), "weight", None)
        wte = self.transformer.wte.weight
        return bool(self.config.tie_embeddings and isinstance(head, Tensor) and head is not wte
                    and (head.shape != wte.shape or not torch.equal(head.detach().cpu(), wte.detach().cpu())))

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # one cache layer per (layer, step), created by forward()

    def _prepare_generated_length(self, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' lengths; a run past max_seq_len is refused before it starts, not at its first token past it."""
        config = super()._prepare_generated_length(generation_config, *args, **kwargs)
        limit, length = self.config.max_seq_len, kwargs.get("input_ids_length")
        # (the last token is sampled, never fed: max_seq_len + 1 tokens in all fit)
        if isinstance(length, int) and config.max_length is not None and config.max_length > limit + 1:
            raise ValueError(f"generate: prompt length {length} + {config.max_length - length} new tokens "
                             f"(max_new_tokens / max_length) run past the model's max_seq_len={limit}")
        return config

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' save; a generation config derived from config.json (`_from_model_config`) that holds our
        options (num_steps, init_scale) is unmarked first: transformers reads a marked file back without them."""
        config = getattr(self, "generation_config", None)
        if config is not None and getattr(config, "_from_model_config", False) and any(
                name in config.__dict__ for name in ("num_steps", "init_scale", *LIBRARY_ONLY_OPTIONS)):
            config._from_model_config = False
        if not self._untied_head():
            return super().save_pretrained(*args, **kwargs)
        self.config.tie_embeddings = False  # (saved as it computes; see _untied_head)
        try:
            return super().save_pretrained(*args, **kwargs)
        finally:
            self.config.tie_embeddings = True

    def _prepare_generation_config(self, generation_config: Any, **kwargs: Any) -> Any:
        """transformers' merge, except that our options set on a GenerationConfig (or the model's) reach forward()
        as keywords, and library-only ones are refused, instead of staying unused attributes of the config."""
        from transformers import GenerationConfig

        config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        standard = GenerationConfig().__dict__
        for name in ("num_steps", "init_scale", *LIBRARY_ONLY_OPTIONS):
            if name in config.__dict__ and name not in standard:
                value = config.__dict__.pop(name)
                if value is not None:
                    model_kwargs[name] = value
        refuse_library_only(model_kwargs)
        if getattr(config, "dola_layers", None) is not None:
            raise ValueError(DOLA_IN_GENERATE)
        return config, model_kwargs

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                                      *args: Any, **kwargs: Any) -> Any:
        """Assisted decoding (`assistant_model=`, `prompt_lookup_num_tokens=`) needs the cache before the first
        forward: create it here for that mode."""
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        # (chunked prefill, `prefill_chunk_size=`, too: it was "Cannot use prefill chunking without a cache")
        needs_cache = (getattr(generation_mode, "value", None) == "assisted_generation"
                       or generation_config.prefill_chunk_size is not None)
        if needs_cache and model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = RecurrentDepthCache(self.config)
        return out

    def _get_candidate_generator(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' candidate generator; an assistant of another architecture gets none of this model's options
        (see `drop_unread_options`)."""
        return drop_unread_options(super()._get_candidate_generator(*args, **kwargs),
                                   GENERATE_FORWARD_OPTIONS)

    def _get_logits_processor(self, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' processors; classifier-free guidance's own forwards take the call's options (see
        `bind_forward_options`)."""
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        bind_forward_options(processors, kwargs.get("model_kwargs"), GENERATE_FORWARD_OPTIONS)
        return processors

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Takase init: std sqrt(2/(5h)); output projections std / sqrt(2 (P + C + R r̄)); +-3 std truncation."""
        cfg = self.config
        std = math.sqrt(2 / (5 * cfg.hidden_size))
        if getattr(module, "is_output_projection", False):
            std = std / math.sqrt(2 * (cfg.prelude_layers + cfg.coda_layers + cfg.core_layers * cfg.mean_recurrence))
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        for name in ("qk_bias", "q_bias", "k_bias"):
            if module._parameters.get(name) is not None:
                nn.init.zeros_(module._parameters[name])

    @property
    def base_model(self) -> nn.Module:
        """The backbone as a callable module returning `last_hidden_state`, the lm_head's input (trl's fused LM
        head calls it; the `transformer` ModuleDict is not callable)."""
        return _Backbone(self)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _context(self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any,
                 position_ids: Tensor | None = None) -> Context:
        """Positions and masks; left padding shifts each row's positions so its first real token is 0 (given
        `position_ids` replace the positions, as in the library; the mask still follows attention_mask)."""
        B, T = input_ids.shape
        device, past = input_ids.device, cache.seen if cache is not None else 0
        valid = attention_mask.bool() if attention_mask is not None else None
        if valid is not None and bool(valid.all()):
            valid = None
        key_positions = (valid.long().cumsum(-1) - 1).clamp(min=0) if valid is not None else None
        if position_ids is not None:
            positions = position_ids.to(device).expand(B, T)
        elif key_positions is not None:
            positions = key_positions[:, past:]
        else:
            positions = torch.arange(past, past + T, device=device).expand(B, T)
        mask = None
        if valid is not None or (past > 0 and T > 1):
            q_idx = torch.arange(past, past + T, device=device)[:, None]
            k_idx = torch.arange(past + T, device=device)[None, :]
            mask = (k_idx <= q_idx)[None, None]
            if valid is not None:  # a padded query sees itself, so no softmax row is empty
                mask = (mask & valid[:, None, None, :]) | (k_idx == q_idx)[None, None]
        return Context(positions, past, mask, cache, self.config, key_positions)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        num_steps: int | tuple[int, int] | None = None,
        init_scale: float | None = None,
        input_states: Tensor | None = None,
        return_dict: bool | None = None,
        generator: torch.Generator | None = None,
        position_ids: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Prelude -> num_steps core steps -> coda; s_0 scaled by init_scale, drawn from `generator` (None: the
        global RNG) unless `input_states` gives it.

        num_steps None: config.mean_recurrence in eval mode; in training mode a depth drawn by config.depth_scheme
        (`training_depth`, from `generator` before s_0), gradients through its last mean_backprop_depth steps.
        An int n: n steps, gradients through all; a pair (n, k): n steps without gradients, then k with
        (`resolve_num_steps`).

        position_ids [B, T] or [1, T] (None: from attention_mask): the RoPE positions of input_ids. A named parameter,
        as the library's: transformers' `generate` then passes this model the positions it passes the library's
        (it counts on from a prompt's last position, where a trailing masked token stands at 0).
        logits_to_keep: the last n positions' logits only (0: all), or those of a 1-D tensor of positions; the head
        runs at those positions only (with no labels), so a named parameter: transformers' `generate` then passes 1.

        output_attentions (None: config.output_attentions): `attentions` holds every attention call's weights
        [B, H, T, past + T] in the order they run: the prelude layers, the core layers of step 1, ..., of the
        last step, the coda layers (computed as plain math instead of SDPA).
        """
        refuse_library_only(kwargs)
        return_hidden = kwargs.pop("_return_hidden", False)  # base_model(): the lm_head's input
        if (attention_mask is None and isinstance(position_ids, Tensor) and position_ids.dim() == 2
                and bool((position_ids[:, 1:] == 0).any())):
            raise ValueError("position_ids restart inside a row (packed examples, trl's padding_free / packing): this "
                             "exported model cannot keep them apart; pad instead, or use the recurrent_depth library")
        legacy = kwargs.pop("past_key_values", None)  # transformers 4's name for the cache
        if legacy is not None and cache is not None and legacy is not cache:
            raise ValueError("pass the cache once: `cache` and `past_key_values` were both given")
        cache = legacy if cache is None else cache
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)  # the Trainer's count of label tokens
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        output_hidden_states = kwargs.pop("output_hidden_states", None)
        output_attentions = kwargs.pop("output_attentions", None)
        unknown = sorted(k for k in kwargs if k not in IGNORED_FORWARD_KWARGS)
        if unknown:
            raise ValueError(f"unexpected forward() arguments {unknown}; this model's options are num_steps, "
                             "init_scale, input_states, generator, position_ids")
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported: pass input_ids (the prelude scales the embedding; "
                             "peft's prompt tuning and p-tuning, which pass it, do not work with this model: "
                             "use LoRA)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        check_ids(input_ids, self.config.vocab_size)  # (before its shape is read)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        return_dict = self.config.return_dict if return_dict is None else return_dict
        cfg = self.config
        free_steps, steps = resolve_num_steps(num_steps, cfg.mean_recurrence)
        scale = cfg.init_scale if init_scale is None else init_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"init_scale={scale!r} is invalid: expected a finite number >= 0")  # (nan: trunc_normal_)
        use_cache = cfg.use_cache if use_cache is None else use_cache
        # Activation checkpointing recomputes each core step in the backward pass: without a cache (a recompute
        # would append its keys again) and without output_attentions (they would be appended again).
        checkpointing = (self.gradient_checkpointing and self.training and torch.is_grad_enabled()
                         and not output_attentions and (cache is None or cache.get_seq_length() == 0))
        if checkpointing:
            cache, use_cache = None, False
        if cache is not None and not isinstance(cache, RecurrentDepthCache):
            if cache.get_seq_length() != 0:
                raise ValueError(f"cache must be a RecurrentDepthCache (or an empty transformers Cache), got "
                                 f"{type(cache).__name__} holding {cache.get_seq_length()} tokens (peft's prefix "
                                 f"tuning passes its prefixes so, which this model does not support: use LoRA)")
            cache = None
        if cache is None and use_cache:
            cache = RecurrentDepthCache(cfg)
        if (cache.seen if cache is not None else 0) + input_ids.shape[1] > cfg.max_seq_len:
            raise ValueError(f"sequence longer than max_seq_len={cfg.max_seq_len}")
        check_mask_and_labels(input_ids, attention_mask, labels, cache.seen if cache is not None else 0, cfg.vocab_size)
        B, T = input_ids.shape
        kept = kept_positions(logits_to_keep, T)
        if position_ids is not None and (
                not isinstance(position_ids, Tensor) or tuple(position_ids.shape) not in ((B, T), (1, T))
                or position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool
                or int(position_ids.min()) < 0 or int(position_ids.max()) >= cfg.max_seq_len):
            raise ValueError(f"position_ids must be integer positions in [0, max_seq_len={cfg.max_seq_len}) of shape "
                             f"[batch, seq_len] = {(B, T)} (or [1, seq_len])")
        if input_states is not None and (not isinstance(input_states, Tensor)
                                         or tuple(input_states.shape) != (B, T, cfg.hidden_size)):
            raise ValueError(f"input_states must have shape [batch, seq_len, hidden_size] = {(B, T, cfg.hidden_size)}, "
                             f"got {tuple(getattr(input_states, 'shape', ())) or type(input_states).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if num_steps is None and self.training:  # (trainers pass none: drawn before s_0, from the same generator)
            free_steps, grad_steps = training_depth(cfg, generator)
            steps = free_steps + grad_steps
        if cache is not None and cache.seen and steps:  # before anything is written: the cached tokens ran as deep
            last = cache.P + cache.C + steps * cache.R - 1
            if last >= len(cache.layers) or cache.layers[last].get_seq_length() < cache.seen:
                raise ValueError(f"the cache holds {cache.seen} tokens computed with fewer core steps than this call's "
                                 f"{steps}: continue a cache at the num_steps that filled it, or start a new one")
        ctx = self._context(input_ids, attention_mask, cache, position_ids)
        if output_attentions:
            ctx.attentions = []

        x = self.transformer.wte(input_ids) * self.emb_scale
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, ctx, ("prelude", i))
        e = x
        if input_states is not None:
            state = input_states.to(e.dtype)
        elif scale == 0:  # the library draws (and discards) the same random numbers here
            state = torch.randn(e.shape, dtype=e.dtype, device=e.device, generator=generator).zero_()
        else:
            state = torch.randn(e.shape, dtype=e.dtype, device=e.device, generator=generator)
            std = math.sqrt(2 / (5 * cfg.hidden_size)) * scale
            nn.init.trunc_normal_(state, std=std, a=-3 * std, b=3 * std, generator=generator)
            state = state * self.emb_scale
        states = [state] if output_hidden_states else None  # s_0..s_r, as the library returns them
        if free_steps:
            with torch.no_grad():
                for step in range(free_steps):
                    state = self._core_step(state, e, ctx, step)
                    if states is not None:
                        states.append(state)
            state = state.detach()
        for step in range(free_steps, steps):
            if checkpointing:
                run = getattr(self, "_gradient_checkpointing_func", None) or self._default_checkpoint
                state = run(self._core_step, state, e, ctx, step)
            else:
                state = self._core_step(state, e, ctx, step)
            if states is not None:
                states.append(state)
        x = self.transformer.ln_f(state)
        for c, block in enumerate(self.transformer.coda):
            x = block(x, ctx, ("coda", c))
        hidden = self.transformer.ln_f(x)
        if cache is not None:
            cache.seen += input_ids.shape[1]
        if return_hidden:
            return BaseModelOutputWithPast(last_hidden_state=hidden, cache=cache if use_cache else None,
                                           hidden_states=tuple(states) if states is not None else None)
        if kept is not None and labels is None:  # (generate keeps 1: no [B, T, V] logits for a long prompt)
            logits = head_at(lambda rows: self.lm_head(rows).float(), hidden, kept[0])[:, kept[1].to(hidden.device)]
        else:  # (a loss reads every position's logits)
            logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).long(), ignore_index=-100,
                reduction="mean" if num_items_in_batch is None else "sum",
            )
            if num_items_in_batch is not None:  # the Trainer then does not divide by gradient accumulation steps
                loss = loss / num_items_in_batch
            logits = kept_logits(logits, logits_to_keep)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None,
                                     hidden_states=tuple(states) if states is not None else None,
                                     attentions=tuple(ctx.attentions) if ctx.attentions is not None else None)
        return out if return_dict else out.to_tuple()

    def _core_step(self, state: Tensor, e: Tensor, ctx: Context, step: int) -> Tensor:
        x = self.transformer.adapter(torch.cat([state, e], dim=-1))
        for j, block in enumerate(self.transformer.core_block):
            x = block(x, ctx, ("core", j, step))
        return x

    @staticmethod
    def _default_checkpoint(function: Any, *args: Any) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(function, *args, use_reentrant=False)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' `generate` at a fixed depth (`num_steps`, `init_scale` pass through to forward)."""
        refuse_library_only(kwargs)
        ids = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input_ids", kwargs.get("inputs"))
        if isinstance(ids, Tensor):  # before transformers indexes an empty prompt (IndexError)
            check_ids(ids, self.config.vocab_size)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            held = cache.get_seq_length() if isinstance(cache, DynamicCache) else 0
            if held >= ids.shape[1]:  # transformers would feed the whole prompt again (or nothing) after the cache
                raise ValueError(f"generate: the cache holds {held} tokens but input_ids has {ids.shape[1]}: pass the "
                                 "whole conversation (the cached tokens and at least one new one) as input_ids")
        return super().generate(*args, **kwargs)


class _Backbone(nn.Module):
    """`RecurrentDepthForCausalLM.base_model`: the model's forward up to the lm_head (same arguments)."""

    def __init__(self, owner: RecurrentDepthForCausalLM, forward: Any = None) -> None:
        super().__init__()
        self.transformer = owner.transformer
        object.__setattr__(self, "_owner", owner)  # not a submodule: the backbone is part of the owner
        # the causal LM's forward: the class's, not the instance's `forward`, which wrappers replace (trl's fused head,
        # accelerate's autocast; re-entered from inside the wrapped call, a nested torch.autocast left autocast on)
        object.__setattr__(self, "_forward", type(owner).forward.__get__(owner) if forward is None else forward)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        if kwargs.get("labels") is not None:
            raise ValueError("base_model() returns hidden states, it takes no labels: call the model for a loss")
        return self._forward(*args, **kwargs, _return_hidden=True)


class RecurrentDepthForSequenceClassification(RecurrentDepthForCausalLM):
    """transformers' sequence classifier (reward models: trl's RewardTrainer): a `score` head
    `Linear(hidden_size, num_labels, bias=False)` in place of the lm_head, read at each row's last token (the last
    position `attention_mask` keeps, else the last token that is not `config.pad_token_id`)."""

    _tied_weights_keys: dict[str, str] = {}
    _keys_to_ignore_on_load_unexpected = [r"^freqs_cis$", r"^lm_head\.weight$"]  # a causal LM's own head
    accepts_loss_kwargs = False  # the loss is a mean over the rows

    def __init__(self, config: RecurrentDepthConfig) -> None:
        super().__init__(config)
        del self.lm_head
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @property
    def base_model(self) -> nn.Module:
        return _Backbone(self, forward=RecurrentDepthForCausalLM.forward.__get__(self))

    def get_output_embeddings(self) -> None:
        return None

    def set_output_embeddings(self, value: nn.Module) -> None:
        raise ValueError("a sequence classifier has no output embeddings (its head is `score`)")

    @classmethod
    def can_generate(cls) -> bool:
        return False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("a sequence classifier does not generate: load the directory with AutoModelForCausalLM")

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, return_dict: bool | None = None, **kwargs: Any) -> Any:
        """Scores [B, num_labels] of each row's last token; the other arguments are the causal LM's forward's."""
        from transformers.loss.loss_utils import ForSequenceClassificationLoss
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        if input_ids is None:
            raise ValueError("input_ids is required")
        kwargs.setdefault("use_cache", False)
        kwargs.pop("margin", None)  # trl's RewardTrainer passes its margins with the batch (its loss reads them)
        out = self.base_model(input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        if attention_mask is not None:
            keep = attention_mask.to(input_ids.device) != 0
        elif self.config.pad_token_id is not None:
            keep = input_ids != self.config.pad_token_id
        elif input_ids.shape[0] == 1:
            keep = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            raise ValueError("a batch of several rows needs an attention_mask or config.pad_token_id to find each "
                             "row's last token")
        if keep.shape != input_ids.shape or not bool(keep.any(-1).all()):
            raise ValueError("attention_mask must match input_ids and keep at least one token in every row")
        last = (positions * keep).argmax(-1).to(hidden.device)
        logits = self.score(hidden[torch.arange(input_ids.shape[0], device=hidden.device), last])
        loss = None
        if labels is not None:
            loss = ForSequenceClassificationLoss(labels=labels, pooled_logits=logits, config=self.config)
        result = SequenceClassifierOutputWithPast(loss=loss, logits=logits, cache=out.cache,
                                                  hidden_states=out.hidden_states)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()
