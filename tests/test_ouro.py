"""Ouro directories (ByteDance LoopLM) load natively: the reference's goldens, the cache, transformers, bad files.

The goldens (tests/goldens/ouro/README.md) were recorded from Ouro's reference modeling file on two tiny
random models stored in bfloat16; every expected value was computed in float32 from those weights, so
the models here are loaded in float32.

Tolerances. Exit probabilities lie in [0, 1]: 1e-5 (measured up to 6.3e-7). Logits: 1e-5 times the
largest logit compared against, also for our cached decode against our full forward (SDPA calls of other
shapes round differently: up to 1.1e-5 on config_b). An absolute 1e-5 would test float32 rounding in the
loop, not the model: on config_b (logits up to 13.3) the reference itself is 2.2e-5 from a float64 run of
our model (norm statistics and RoPE still float32) and our float32 run 1.9e-5; on config_a (up to 3.6)
both are 4e-6 from it. A wrong mapping fails these tests (checked: k/v swapped, gate/up swapped,
norm_2/norm_3 swapped).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM

import recurrent_depth as rd
from recurrent_depth.checkpoint import stored_dtype
from recurrent_depth.cli import main
from recurrent_depth.config import HUGINN_ARCHITECTURE
from recurrent_depth.integrations import register_transformers
from recurrent_depth.integrations.hf import RecurrentDepthForCausalLM
from recurrent_depth.integrations.hf_config import OuroConfig, RecurrentDepthConfig

register_transformers()
GOLDENS = Path(__file__).parent / "goldens" / "ouro"
CASES = ("config_a", "config_b")
PROB_ATOL = 1e-5
LOGIT_RTOL_OF_SCALE = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def expected(case: str) -> dict[str, torch.Tensor]:
    return load_file(GOLDENS / case / "expected.safetensors")


def load(case: str) -> rd.RecurrentDepthLM:
    return rd.RecurrentDepthLM.from_pretrained(GOLDENS / case, dtype=torch.float32).eval()


def assert_logits(ours: torch.Tensor, golden: torch.Tensor) -> None:
    atol = LOGIT_RTOL_OF_SCALE * golden.abs().max().item()
    torch.testing.assert_close(ours, golden, rtol=0, atol=atol)


def exit_pdf(lambdas: torch.Tensor) -> torch.Tensor:
    """The paper's exit distribution from per-step lambdas [B, S, T]: p_t = lambda_t prod_{j<t}(1 - lambda_j),
    the last step taking the mass left."""
    survive = torch.ones_like(lambdas[..., 0])
    pdf = []
    for t in range(lambdas.shape[-1]):
        p = survive if t == lambdas.shape[-1] - 1 else lambdas[..., t] * survive
        pdf.append(p)
        survive = survive * (1 - lambdas[..., t])
    return torch.stack(pdf, dim=-1)


def exit_steps(pdf: torch.Tensor, q: float) -> torch.Tensor:
    """The first step whose cumulative exit probability reaches q, else the last."""
    reached = pdf.cumsum(-1) >= q
    return torch.where(reached.any(-1), reached.float().argmax(-1), pdf.shape[-1] - 1)


# ----------------------------------------------------------------------------------------------- goldens
@pytest.mark.parametrize("case", CASES)
def test_every_step_and_the_exit_gate_match_the_reference(case):
    gold = expected(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of a real Ouro config.json is known: nothing to warn about
        model = load(case)
    steps = model.config.mean_recurrence
    assert steps == gold["per_step_logits"].shape[0] and model.config.exit_gate_threshold == 1.0
    with torch.no_grad():
        out = model(gold["input_ids"], num_steps=steps, output_all_states=True)
        per_step = torch.stack([model.lm_head(out.all_states[t + 1]).float() for t in range(steps)])
        lambdas = torch.stack([model.exit_probability(out.all_states[t + 1]) for t in range(steps)], dim=-1)
    assert_logits(per_step, gold["per_step_logits"])
    assert torch.equal(out.logits, per_step[-1])
    torch.testing.assert_close(lambdas, torch.sigmoid(gold["gate_logits"]).permute(1, 2, 0), rtol=0, atol=PROB_ATOL)
    pdf = exit_pdf(lambdas)
    torch.testing.assert_close(pdf, gold["exit_pdf"], rtol=0, atol=PROB_ATOL)
    # The paper's rule on our pdf reads the steps the reference read: at its default q (the config's
    # early_exit_threshold) and at a q that spreads the exits (no cumulative within 1e-3 of it).
    assert torch.equal(exit_steps(pdf, model.config.exit_gate_threshold), gold["default_exit_steps"])
    chosen = exit_steps(pdf, gold["exit_threshold"].item())
    assert torch.equal(chosen, gold["threshold_exit_steps"])
    picked = per_step.permute(1, 2, 0, 3)[torch.arange(2)[:, None], torch.arange(chosen.shape[1]), chosen]
    assert_logits(picked, gold["threshold_logits"])
    assert_logits(per_step[gold["exit_at_step"].item()], gold["exit_at_step_logits"])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference-runner"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_then_decode_equals_the_full_forward_and_the_reference(case, fast):
    gold = expected(case)
    model = load(case)
    ids = gold["input_ids"]
    prompt = ids.shape[1] - 2
    with torch.no_grad():
        full = model(ids).logits
        prefill = model(ids[:, :prompt]).logits
    teacher = torch.cat([ids[:, prompt:], ids[:, -1:]], dim=1)  # the third token is chosen, never fed
    out = rd.generate(model, ids[:, :prompt], max_new_tokens=3, teacher_tokens=teacher, output_logits=True,
                      fast=fast)
    assert_logits(out.logits, full[:, prompt - 1:])
    assert_logits(prefill, gold["decode_prefill_logits"])
    decoded = torch.cat([gold["decode_prefill_logits"][:, -1:], gold["decode_step1_logits"],
                         gold["decode_step2_logits"]], dim=1)
    assert_logits(out.logits, decoded)
    assert out.steps.tolist() == [[model.config.mean_recurrence] * 3] * 2


@pytest.mark.parametrize("options", [{}, dict(exit_criterion="gate", exit_threshold=0.5)], ids=["fixed", "gate"])
def test_a_left_padded_row_generates_what_it_does_alone(options):
    """s_0 = e: a padded row starts from its own tokens' embeddings, not the padding's."""
    model = load("config_a")
    ids = expected("config_a")["input_ids"]
    short = ids[1:, 3:]
    batch = torch.cat([ids[:1], torch.cat([torch.zeros_like(ids[1:, :3]), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    run = dict(max_new_tokens=4, output_logits=True, **options)
    together = rd.generate(model, batch, attention_mask=mask, **run)
    for b, alone_ids in enumerate([ids[:1], short]):
        alone = rd.generate(model, alone_ids, **run)
        assert together.token_lists()[b] == alone.token_lists()[0]
        torch.testing.assert_close(together.logits[b], alone.logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_a_chunk_after_a_prefill_equals_the_full_forward(case):
    """Two or more tokens after a cached prefill: the case the reference's cache fails (goldens README)."""
    model = load(case)
    ids = expected(case)["input_ids"]
    cache = rd.DynamicCache()
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :3], cache=cache).logits
        rest = model(ids[:, 3:], cache=cache).logits
    assert_logits(torch.cat([first, rest], dim=1), full)
    assert len(cache.kv) == model.config.core_layers * model.config.mean_recurrence  # one entry per (layer, step)


# ----------------------------------------------------------------------------------------------- transformers
def test_auto_model_loads_an_ouro_directory_without_remote_code(tmp_path):
    case = GOLDENS / "config_a"
    library = load("config_a")
    assert isinstance(AutoConfig.from_pretrained(case), OuroConfig)
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).eval()
    assert isinstance(model, RecurrentDepthForCausalLM) and isinstance(model.config, RecurrentDepthConfig)
    ids = expected("config_a")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, library(ids).logits)
    assert AutoModelForCausalLM.from_pretrained(case).dtype == torch.bfloat16  # the stored dtype
    shallow = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32, total_ut_steps=2).eval()
    with torch.no_grad():
        assert torch.equal(shallow(ids).logits, library(ids, num_steps=2).logits)
    theirs = model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    ours = rd.generate(library, ids, max_new_tokens=4)
    assert torch.equal(theirs, ours.sequences)
    model.save_pretrained(tmp_path)  # our format, through transformers too
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "recurrent_depth"
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, library(ids).logits)


def test_auto_model_keeps_transformers_output_flags_for_an_ouro_directory():
    """from_pretrained(ouro_dir, output_attentions=True / output_hidden_states=True / return_dict=False) put the
    flags on the OuroConfig only: the returned model's config had the defaults, so they were silently dropped."""
    case = GOLDENS / "config_a"
    ids = expected("config_a")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32, output_attentions=True,
                                                 output_hidden_states=True).eval()
    with torch.no_grad():
        out = model(ids)
    steps = model.config.mean_recurrence
    assert len(out.attentions) == model.config.core_layers * steps and len(out.hidden_states) == steps + 1
    assert isinstance(AutoModelForCausalLM.from_pretrained(case, return_dict=False)(ids), tuple)


def test_auto_model_takes_the_loading_options_lm_eval_passes_as_none():
    """lm-eval's hf backend (and our lm-eval backend through it) passes gguf_file, max_memory and
    quantization_config to from_pretrained, all None: an Ouro directory was refused as "unsupported arguments";
    one that asks for something is still refused in one line."""
    case = GOLDENS / "config_a"
    model = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32, gguf_file=None, max_memory=None,
                                                 quantization_config=None)
    assert isinstance(model, RecurrentDepthForCausalLM)
    with pytest.raises(ValueError, match="unsupported arguments \\['max_memory'\\]"):
        AutoModelForCausalLM.from_pretrained(case, max_memory={"cpu": 2**30})


def test_auto_sequence_classification_loads_an_ouro_directory(tmp_path):
    """AutoModelForSequenceClassification refused an Ouro directory (unrecognized configuration class OuroConfig);
    now the Ouro backbone with a fresh score head on each row's last token, saved in our format."""
    from transformers import AutoModelForSequenceClassification

    from recurrent_depth.integrations.hf_seq_cls import RecurrentDepthForSequenceClassification

    case = GOLDENS / "config_a"
    labels = {0: "neg", 1: "neu", 2: "pos"}
    model = AutoModelForSequenceClassification.from_pretrained(
        case, dtype=torch.float32, id2label=labels, label2id={v: k for k, v in labels.items()}, total_ut_steps=2)
    assert isinstance(model, RecurrentDepthForSequenceClassification) and not model.training
    assert model.config.id2label == labels and model.config.mean_recurrence == 2
    assert model.score.weight.shape == (3, model.config.hidden_size) and not hasattr(model, "lm_head")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    lm = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32, total_ut_steps=2).eval()
    ids = expected("config_a")["input_ids"]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        scores = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(scores, model.score(lm.base_model(ids).last_hidden_state[:, -1]))
    loss = model(ids, attention_mask=mask, labels=torch.zeros(ids.shape[0], dtype=torch.long)).loss
    loss.backward()
    assert model.transformer.wte.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "RecurrentDepthForSequenceClassification"]
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert back.config.id2label == labels
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, scores)


def test_transformers_config_round_trips_every_model_config_field(tmp_path):
    declared = set(RecurrentDepthConfig.__annotations__)
    missing = sorted(f.name for f in rd.ModelConfig.__dataclass_fields__.values() if f.name not in declared)
    assert missing == []
    changed = dict(block_layout="peri-norm", rope_style="half", qk_norm=True, qk_norm_full_width=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                   qkv_bias=True, mlp_activation="gelu", embedding_scale=False, norm_before_coda=False,
                   final_norm=False, step_norm=True, injection="add", state_init="embedding", exit_gate=True,
                   exit_gate_threshold=0.75, mlp_gated=False, qk_norm_eps=1e-7, prelude_norm=True,
                   coda_projection=True, value_embeddings=[1], attention_windows=[None, 3, None, 2],
                   query_pre_attn_scalar=12.0, attn_logit_softcapping=30.0, final_logit_softcapping=20.0,
                   layer_rope_bases=[None, 1e4, None, None], transformers_rounding=True, norm_unit_offset=True,
                   norm_float32_gain=True, eager_attention=True)
    defaults = rd.ModelConfig()
    assert {name for name in changed if getattr(defaults, name) == changed[name]} == set()
    assert set(HUGINN_ARCHITECTURE) <= set(changed)
    config = rd.ModelConfig.from_preset("tiny", **changed)
    RecurrentDepthConfig.from_model_config(config).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).to_model_config() == config
    assert rd.ModelConfig.from_json(tmp_path) == config


# ----------------------------------------------------------------------------------------------- files
def write_ouro_layout(model: rd.RecurrentDepthLM, path: Path, dtype: torch.dtype, shards: int = 1) -> None:
    """`model` as an Ouro directory (the reference's names, q/k/v and gate/up apart), optionally sharded."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
    state = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
             "model.norm.weight": sd["transformer.ln_f.weight"],
             "model.early_exit_gate.weight": sd["transformer.exit_gate.weight"],
             "model.early_exit_gate.bias": sd["transformer.exit_gate.bias"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = sd["lm_head.weight"]
    for n in range(cfg.core_layers):
        ours, theirs = f"transformer.core_block.{n}.", f"model.layers.{n}."
        for name, tensor in zip(("q", "k", "v"), sd[ours + "attn.Wqkv.weight"].split([q, kv, kv])):
            state[f"{theirs}self_attn.{name}_proj.weight"] = tensor.clone()
        gate, up = sd[ours + "mlp.fc.weight"].chunk(2)
        state.update({theirs + "self_attn.o_proj.weight": sd[ours + "attn.proj.weight"],
                      theirs + "mlp.gate_proj.weight": gate.clone(), theirs + "mlp.up_proj.weight": up.clone(),
                      theirs + "mlp.down_proj.weight": sd[ours + "mlp.proj.weight"]})
        for mine, ref in (("norm_1", "input_layernorm"), ("norm_2", "input_layernorm_2"),
                          ("norm_3", "post_attention_layernorm"), ("norm_4", "post_attention_layernorm_2")):
            state[f"{theirs}{ref}.weight"] = sd[f"{ours}{mine}.weight"]
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "ouro", "architectures": ["OuroForCausalLM"], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.core_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
              "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
              "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "use_sliding_window": False,
              "sliding_window": None, "total_ut_steps": cfg.mean_recurrence, "early_exit_threshold": 1.0,
              "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: state[k] for k in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("dtype,shards,tied", [(torch.float32, 3, False), (torch.bfloat16, 1, True)],
                         ids=["fp32-sharded-untied", "bf16-single-tied"])
def test_an_ouro_layout_loads_our_tensors_back_bit_for_bit(tmp_path, dtype, shards, tied):
    torch.manual_seed(5)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", tie_embeddings=tied)).eval()
    write_ouro_layout(model, tmp_path, dtype, shards)
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert loaded.dtype == dtype and stored_dtype(tmp_path) == dtype
    want = {k: v.to(dtype) for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == tied


def test_saving_a_loaded_ouro_model_writes_our_format_and_reads_back(tmp_path):
    model = rd.RecurrentDepthLM.from_pretrained(GOLDENS / "config_a")  # bf16, as stored
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "recurrent_depth" and saved["exit_gate_threshold"] == 1.0
    tensors = load_file(tmp_path / "model.safetensors")
    source = load_file(GOLDENS / "config_a" / "model.safetensors")
    fused = torch.cat([source[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(tensors["transformer.core_block.1.attn.Wqkv.weight"], fused)
    assert all(name.startswith(("transformer.", "lm_head.")) for name in tensors)
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert again.config == model.config and again.dtype == torch.bfloat16
    ids = expected("config_a")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def copy_case(tmp_path: Path, case: str = "config_a", config: dict | None = None, drop: str | None = None,
              replace: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of a golden directory with its config.json keys changed and tensors dropped or replaced."""
    out = tmp_path / case
    shutil.copytree(GOLDENS / case, out)
    values = json.loads((out / "config.json").read_text())
    values.update(config or {})
    (out / "config.json").write_text(json.dumps(values))
    if drop or replace:
        state = load_file(out / "model.safetensors")
        state.pop(drop, None)
        state.update(replace or {})
        save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("change,needle", [
    (dict(config=dict(use_sliding_window=True, sliding_window=0, max_window_layers=1, layer_types=None)),
     r"layers \[1\] use sliding.*sliding_window=0 give no window"),
    (dict(config=dict(layer_types=["sliding_attention", "full_attention"])),
     r"layers \[0\] use sliding.*use_sliding_window=False"),
    (dict(config=dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})), "rope_type 'yarn' is not supported"),
    (dict(config=dict(rope_scaling={"type": "linear"})), "factor"),
    (dict(config=dict(hidden_act="gelu_new")), "hidden_act='gelu_new'"),
    (dict(config=dict(attention_dropout=0.1)), "attention_dropout=0.1"),
    (dict(config=dict(total_ut_steps=0)), "total_ut_steps=0"),
    (dict(config=dict(early_exit_threshold=1.5)), "early_exit_threshold"),
    (dict(config=dict(num_hidden_layers=3, layer_types=["full_attention"] * 3)),
     "num_hidden_layers=3 but the weights hold 2 layers"),
    (dict(config=dict(hidden_size=None)), "hidden_size"),
    (dict(drop="model.layers.1.self_attn.k_proj.weight"), r"missing tensors: \['model.layers.1.self_attn.k_proj"),
    (dict(replace={"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}),
     r"model.layers.0.mlp.up_proj.weight: file \(95, 64\) vs config \(96, 64\)"),
    (dict(replace={"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}), "unexpected tensors"),
    (dict(replace={"model.norm.weight": torch.zeros(64, dtype=torch.int32)}), "not floating point"),
], ids=["sliding-window", "sliding-layer-types", "rope-yarn", "rope-no-factor", "activation", "dropout",
        "zero-steps", "threshold", "layer-count", "no-hidden-size", "missing-tensor", "wrong-shape",
        "unexpected-tensor", "int-tensor"])
def test_a_bad_ouro_directory_is_a_one_line_error_naming_it(tmp_path, change, needle):
    directory = copy_case(tmp_path, **change)
    with pytest.raises(ValueError, match=needle) as info:
        rd.RecurrentDepthLM.from_pretrained(directory)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config,windows", [
    (dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, layer_types=None), [None, 3]),
    (dict(use_sliding_window=True, sliding_window=2, layer_types=["sliding_attention", "full_attention"]), [2, None]),
    (dict(use_sliding_window=False, sliding_window=3, max_window_layers=0, layer_types=None), []),
], ids=["max-window-layers", "layer-types", "switched-off"])
def test_ouro_sliding_window_layers_load_with_their_window(tmp_path, config, windows):
    """Sliding layers (Qwen2's rule, as the reference's config) load with their window, which acts: a window
    covering the 7-token goldens reproduces them, a shorter one changes the logits at positions past it."""
    model = rd.RecurrentDepthLM.from_pretrained(copy_case(tmp_path, config=config), dtype=torch.float32)
    assert model.config.attention_windows == windows
    assert [b.attn.window for b in model.transformer.core_block] == (windows or [None, None])
    want = expected("config_a")
    with torch.no_grad():
        got = model(want["input_ids"], num_steps=4).logits
        for block in model.transformer.core_block:
            block.attn.window = 7 if block.attn.window else None
        covering = model(want["input_ids"], num_steps=4).logits
    torch.testing.assert_close(covering, want["per_step_logits"][-1], rtol=1e-4, atol=1e-4)
    if windows:
        window = min(w for w in windows if w)
        torch.testing.assert_close(got[:, :window], covering[:, :window], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[:, window:], covering[:, window:], atol=1e-3)


def test_the_published_ouro_1_4b_config_is_the_preset():
    """Ouro-1.4B's published shape, as its config.json states it, translates to the preset `ouro-1.4b`."""
    published = {"model_type": "ouro", "architectures": ["OuroForCausalLM"], "vocab_size": 49152, "hidden_size": 2048,
                 "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 65536,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
                 "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "total_ut_steps": 4,
                 "early_exit_threshold": 1.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
                 "torch_dtype": "bfloat16", "transformers_version": "4.55.0", "initializer_range": 0.02}
    config = rd.ModelConfig.from_dict(published)
    assert config == rd.ModelConfig.from_preset("ouro-1.4b", exit_gate_threshold=1.0)
    assert config.num_parameters() == 1_434_652_673


def test_an_unknown_config_key_is_ignored_with_a_warning(tmp_path):
    directory = copy_case(tmp_path, config=dict(ouro_future_option=3))
    with pytest.warns(UserWarning, match="ouro_future_option"):
        rd.RecurrentDepthLM.from_pretrained(directory)


def test_rdepth_generate_runs_an_ouro_directory(tmp_path, capsys):
    directory = copy_case(tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    assert main(["generate", "--model", str(directory), "--prompt", "w17 w3 w99", "--max-new-tokens", "4",
                 "--dtype", "float32"]) == 0
    model = load("config_a")
    want = rd.generate(model, torch.tensor([[17, 3, 99]]), max_new_tokens=4).sequences[0, 3:].tolist()
    assert tok.decode(want) in capsys.readouterr().out


def test_rdepth_train_init_from_an_ouro_directory(tmp_path):
    """One step of `rdepth train --init-from` on an Ouro directory: the run saves our format, in its dtype."""
    from recurrent_depth.checkpoint import copy_tokenizer
    from tests.test_init_from import train_flags
    from tests.train_support import VOCAB, prepare_root

    root = prepare_root(tmp_path / "root")
    torch.manual_seed(3)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=VOCAB, max_seq_len=64)).eval()
    write_ouro_layout(model, tmp_path / "ouro", torch.bfloat16)
    copy_tokenizer(root / "tokenizer", tmp_path / "ouro")
    assert main(train_flags(root, tmp_path / "ouro", tmp_path / "run", "--max-steps", "1")) == 0
    trained = rd.RecurrentDepthLM.from_pretrained(tmp_path / "run" / "model")
    assert trained.dtype == torch.bfloat16 and trained.config == rd.ModelConfig.from_json(tmp_path / "ouro")
    before = model.transformer.core_block[0].attn.Wqkv.weight.to(torch.bfloat16)
    assert not torch.equal(trained.transformer.core_block[0].attn.Wqkv.weight, before)  # it trained


def test_the_ouro_dialect_keeps_the_config_module_free_of_torch():
    """config.py imports families/ouro.py; importing the config still loads no torch (a light `rdepth --version`)."""
    import subprocess
    import sys

    code = "import sys, recurrent_depth.config; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
