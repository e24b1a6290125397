"""muP (ModelConfig.mup_base_width): init and per-layer Adam lr multipliers; coordinate check; the experiments."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.experiments.common import byte_tokens
from recurrent_depth.experiments.mup import MupConfig, coordinate_check
from recurrent_depth.train.optim import OptimConfig, build_optimizers

pytestmark = pytest.mark.usefixtures("one_thread")
# Coordinate-check settings of the test: seeds averaged and sequence length (measured: muP 1.22, standard 4.0).
COORD_SEEDS, COORD_SEQ = 2, 32


def model(width: int, base: int | None, seed: int = 0) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(
        "tiny", hidden_size=width, num_heads=width // 16, head_dim=16, tie_embeddings=False, mup_base_width=base))


def scales(m: rd.RecurrentDepthLM, name: str = "adamw") -> dict[str, float]:
    opt = build_optimizers(m, OptimConfig(name=name, lr=1e-3))
    return {n: g["lr_scale"] for g in opt.param_groups for n in g["param_names"]}


def test_mup_at_the_base_width_is_the_standard_parametrization():
    mup, standard = model(64, base=64), model(64, base=None)
    for (n, a), (_, b) in zip(mup.state_dict().items(), standard.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert scales(mup) == scales(standard)


def test_mup_lr_multipliers_and_head_init_follow_tensor_programs_v():
    m = model(256, base=64)  # width multiplier 4
    lr = scales(m)
    assert lr["transformer.wte.weight"] == 0.5  # embedding: 1/sqrt(m) (the model multiplies it by sqrt(h))
    assert lr["lm_head.weight"] == 0.25  # output: 1/m
    assert lr["transformer.adapter.weight"] == 0.25  # hidden: 1/m, the adapter ...
    assert lr["transformer.core_block.0.attn.Wqkv.weight"] == 0.25  # ... the recurrent core ...
    assert lr["transformer.prelude.0.mlp.fc.weight"] == 0.25  # ... and prelude / coda blocks
    assert lr["transformer.core_block.0.norm_1.weight"] == 1.0 and lr["transformer.ln_f.weight"] == 1.0
    head_std = float(m.lm_head.weight.detach().std())
    assert head_std == pytest.approx(math.sqrt(2 / (5 * 256)) / 2, rel=0.05)  # std / sqrt(m)
    muon = scales(m, "muon")  # Muon keeps its own scaling for the matrices
    assert muon["transformer.core_block.0.attn.Wqkv.weight"] == OptimConfig().muon_lr / 1e-3
    assert muon["transformer.wte.weight"] == 0.5


def test_mup_value_embeddings_are_input_weights_with_a_width_independent_init_and_lr():
    """A value embedding (a vocabulary lookup added to v, not scaled by sqrt(h)) and its gate (32 channels in)
    have a fan-in that does not grow with width: muP's input weights, Adam lr x 1 and an init that does not
    shrink as the model widens (it had taken the token embedding's 1/sqrt(m) and the Takase 1/sqrt(h) std)."""
    def with_value_embedding(width: int, base: int | None) -> rd.RecurrentDepthLM:
        torch.manual_seed(0)
        return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(
            "tiny", hidden_size=width, num_heads=width // 16, head_dim=16, tie_embeddings=False,
            mup_base_width=base, value_embeddings=[0]))

    wide = with_value_embedding(256, base=64)
    lr = scales(wide)
    name = "transformer.prelude.0.attn"
    assert lr[f"{name}.value_embed.weight"] == 1.0 and lr[f"{name}.ve_gate.weight"] == 1.0
    assert lr["transformer.wte.weight"] == 0.5  # the token embedding keeps 1/sqrt(m)
    base_std = math.sqrt(2 / (5 * 64))
    for part in ("value_embed", "ve_gate"):
        std = float(wide.get_parameter(f"{name}.{part}.weight").detach().std())
        assert std == pytest.approx(base_std, rel=0.1), part
    standard, at_base = with_value_embedding(64, base=None), with_value_embedding(64, base=64)
    for (n, a), (_, b) in zip(standard.state_dict().items(), at_base.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert scales(standard) == scales(at_base)


def test_mup_needs_untied_embeddings_and_a_valid_width():
    with pytest.raises(ValueError, match="tie_embeddings"):
        rd.ModelConfig.from_preset("tiny", mup_base_width=32)
    with pytest.raises(ValueError, match="mup_base_width"):
        rd.ModelConfig.from_preset("tiny", mup_base_width=0, tie_embeddings=False)
    cfg = rd.ModelConfig.from_preset("tiny", mup_base_width=32, tie_embeddings=False)
    assert rd.ModelConfig.from_json(cfg.to_json()).mup_base_width == 32 and cfg.width_multiplier == 2.0


@pytest.mark.parametrize("settings, field", [
    ({"head_dim": 0}, "head_dim"), ({"base_width": 0, "widen": "head_dim"}, "base_width"), ({"seeds": 0}, "seeds"),
    ({"transfer_steps": 0}, "transfer_steps"), ({"steps": -1}, "steps"), ({"widths": (64, 64)}, "widths"),
])
def test_bad_experiment_settings_name_the_field(settings, field):
    """head_dim 0 was a ZeroDivisionError, seeds 0 an IndexError and transfer_steps 0 a ZeroDivisionError deep in
    the run; repeated widths made the across-width ratio trivially 1."""
    with pytest.raises(ValueError, match=field):
        MupConfig(**settings)


def test_experiment_out_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("x")
    assert main(["experiment", "coord-check", "--widths", "32,64", "--base-width", "32", "--steps", "1", "--seeds",
                 "1", "--out", str(target)]) == 2
    assert "is an existing file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.train_support import write_corpus

    return byte_tokens(str(write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=20)))


@pytest.mark.slow
def test_coordinate_check_is_width_independent_under_mup_only(tokens):
    cfg = MupConfig(widths=(64, 128, 256), steps=5, seeds=COORD_SEEDS, batch_size=8, seq_len=COORD_SEQ)
    result = coordinate_check(cfg, tokens)
    assert result["mup"]["max_ratio"] <= 1.3, result["mup"]["ratio_after_last_step"]
    # reported for the standard parametrization: the same check fails there
    assert result["standard"]["max_ratio"] > 2.0, result["standard"]["ratio_after_last_step"]


def test_lr_transfer_command_writes_its_table_and_plot(tmp_path, capsys):
    from tests.train_support import write_corpus

    corpus = write_corpus(tmp_path / "corpus", num_docs=10)
    out = tmp_path / "mup"
    assert main(["experiment", "lr-transfer", "--widths", "32,64", "--base-width", "32", "--lrs", "0.001,0.01",
                 "--steps", "2", "--transfer-steps", "3", "--seeds", "1", "--batch-size", "2", "--seq-len", "16",
                 "--corpus", str(corpus), "--out", str(out)]) == 0
    result = json.loads((out / "mup_lr_transfer.json").read_text())
    assert (out / "mup_lr_transfer.png").stat().st_size > 10_000
    for parametrization in ("standard", "mup"):
        table = result["lr_transfer"][parametrization]["final_loss"]
        assert set(table) == {"32", "64"} and all(set(row) == {"0.001", "0.01"} for row in table.values())
    assert "best lr transfers" in capsys.readouterr().out


def test_coord_check_takes_no_transfer_flags_it_would_ignore(capsys):
    """`coord-check --lrs ... --transfer-steps ...` was accepted and silently ignored (no transfer sweep runs)."""
    for flag, value in (("--lrs", "0.001,0.01"), ("--transfer-steps", "3")):
        with pytest.raises(SystemExit) as exc:
            main(["experiment", "coord-check", flag, value])
        assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "coord-check", "--help"])
    text = capsys.readouterr().out
    assert "--lrs" not in text and "--transfer-steps" not in text and "--widths" in text


# ------------------------------------------------------------------ the attention scale (attn_scale)
def widened(hidden: int, base: int = 64, **overrides) -> rd.ModelConfig:
    """tiny at 4 heads widened by hidden_size alone (head_dim = hidden / 4), muP based at width 64 (d_0 = 16)."""
    return rd.ModelConfig.from_preset("tiny", hidden_size=hidden, tie_embeddings=False, mup_base_width=base,
                                      **overrides)


def test_mup_resolves_the_attention_scale_to_1_over_d_and_standard_keeps_1_over_sqrt_d():
    assert rd.ModelConfig.from_preset("huginn-0125").attention_scale_rule == "1/sqrt(d)"
    standard = rd.ModelConfig.from_preset("tiny", hidden_size=256)
    assert standard.attention_scale == 64**-0.5 and standard.uses_huginn_layout
    mup = widened(256)  # head_dim 64, grown from 16 at the base width
    assert (mup.attention_scale_rule, mup.base_head_dim) == ("1/d", 16.0)
    assert mup.attention_scale == math.sqrt(16) / 64  # 1/d, equal to 1/sqrt(d) at the base width
    assert widened(64).attention_scale == 16**-0.5
    fixed = widened(256, num_heads=16, mup_base_head_dim=16)  # the sweep adds heads: 1/d = 1/sqrt(d) there
    assert fixed.attention_scale == 16**-0.5 and fixed.uses_huginn_layout
    assert not mup.uses_huginn_layout  # the fused runner and the remote-code export do 1/sqrt(d) only
    again = rd.ModelConfig.from_json(widened(256, attn_scale="1/d", mup_base_head_dim=16).to_json())
    assert (again.attn_scale, again.mup_base_head_dim) == ("1/d", 16)


@pytest.mark.parametrize("bad, field", [
    (dict(attn_scale="1/d"), "attn_scale"),  # without muP
    (dict(attn_scale="sqrt"), "attn_scale"),
    (dict(mup_base_head_dim=16), "mup_base_head_dim"),  # without muP
    (dict(mup_base_width=64, tie_embeddings=False, mup_base_head_dim=0), "mup_base_head_dim"),
], ids=["1/d-without-mup", "unknown-name", "base-head-dim-without-mup", "base-head-dim-zero"])
def test_bad_attention_scale_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}="):
        rd.ModelConfig.from_preset("tiny", **bad)


def test_a_non_mup_combination_warns():
    from recurrent_depth.config import MupShapeWarning

    with pytest.warns(MupShapeWarning, match=r"attn_scale='1/sqrt\(d\)' while head_dim grows from 16"):
        widened(256, attn_scale="1/sqrt(d)")
    with pytest.warns(MupShapeWarning, match="not a whole head"):
        widened(256, base=50)  # head_dim 64 at width 256 is 12.5 at width 50
    with warnings.catch_warnings():
        warnings.simplefilter("error", MupShapeWarning)  # the muP combinations are silent
        widened(256)
        widened(256, num_heads=16, mup_base_head_dim=16, attn_scale="1/sqrt(d)")
        rd.ModelConfig.from_preset("tiny", hidden_size=256, attn_scale="1/sqrt(d)")  # no muP, nothing to say


def test_attention_uses_the_scale_in_sdpa_the_max_logit_and_the_quantized_cache():
    torch.manual_seed(0)
    m = rd.RecurrentDepthLM(widened(128, mean_recurrence=2)).eval()  # head_dim 32, scale 4/32
    attn = m.transformer.core_block[0].attn
    assert attn.scale == 0.125
    seen = []
    hook = attn.register_forward_hook(lambda mod, inputs, out: seen.append((inputs, out)) and None)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        m(ids, num_steps=1, init_scale=0.0)
    hook.remove()
    (x, ctx, _), out = seen[0]
    q, k, v = (t.transpose(1, 2) for t in attn.qkv(x, ctx))  # [B, H, T, D]
    logits = (q @ k.mT) * 0.125
    logits = logits.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    expected = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, -1))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    attn.train()
    attn.record_max_logit = True
    with torch.no_grad():
        attn(x, ctx, ("core", 0, 0))
    torch.testing.assert_close(attn.max_logit, logits.amax(dim=(0, 2, 3)), atol=1e-5, rtol=0)
    attn.record_max_logit = False
    attn.eval()
    # a quantized cache scoring from its codes (kernels at 1/sqrt(D)) equals decode + SDPA at the model's scale
    run = dict(max_new_tokens=4, num_steps=2, init_scale=0.0, output_logits=True)
    codes = rd.generate(m, ids, kv_quant="k=mse:4,v=mse:4,attn=codes", **run)
    decoded = rd.generate(m, ids, kv_quant="k=mse:4,v=mse:4,attn=dequantize", **run)
    torch.testing.assert_close(torch.stack(list(codes.logits)), torch.stack(list(decoded.logits)), atol=1e-4, rtol=0)


def test_the_fast_runner_declines_a_non_default_scale():
    from recurrent_depth.accel.runner import FastRunner

    assert not FastRunner.supports(rd.RecurrentDepthLM(widened(128)))
    assert FastRunner.supports(rd.RecurrentDepthLM(widened(128, attn_scale="1/sqrt(d)", mup_base_head_dim=32)))


def test_coordinate_check_passes_with_1_over_d_and_a_growing_head_dim(tokens):
    """heads fixed at 4, head_dim 16 -> 64: muP (1/d) keeps the activations width-independent; its attention
    logits do not grow with width (at init 1/d shrinks them by 1/sqrt(m)), while muP with 1/sqrt(d) lets them grow
    (measured, width 64 -> 256: 0.54-0.64x vs 1.09-1.27x; activations max/min 1.27)."""
    cfg = MupConfig(widths=(64, 256), widen="head_dim", steps=5, seeds=3, batch_size=8, seq_len=COORD_SEQ,
                    parametrizations=("mup", "mup-sqrt-d"))  # (standard fails the check: the test above)
    result = coordinate_check(cfg, tokens)
    assert result["mup"]["max_ratio"] <= 1.3, result["mup"]["ratio_after_last_step"]

    def growth(parametrization: str) -> dict[str, float]:
        rms = result[parametrization]["rms"]
        return {layer: rms["256"][layer][-1] / rms["64"][layer][-1] for layer in rms["64"] if layer.endswith(".qk")}

    assert max(growth("mup").values()) < 1.0, growth("mup")
    assert min(growth("mup-sqrt-d").values()) > 1.05, growth("mup-sqrt-d")
