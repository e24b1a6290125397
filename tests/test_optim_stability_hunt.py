"""Regressions from the optimizer / stability-option hunt: QK-clip under LoRA, Muon settings checked up front."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.muon import Muon
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("one_thread")


def test_qk_clip_refuses_a_lora_model_and_still_records_it():
    """QK-clip on a LoRA model rescaled the frozen base W_q/W_k (not in the saved adapter) and left the adapter's
    update unclipped: a core head at 1198 after clipping to tau 1. Clipping is refused; recording still works."""
    pytest.importorskip("peft")
    from recurrent_depth.train.lora import LoraSpec, add_lora

    torch.manual_seed(0)
    wrapped = add_lora(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")),
                       LoraSpec(rank=4, parts=("core",), kinds=("attention",)), seed=0)
    with pytest.raises(ValueError, match="frozen"):
        QKClip(wrapped, threshold=1.0)
    clip = QKClip(wrapped)  # record only
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    wrapped.train()
    wrapped(torch.randint(0, 256, (1, 16)), num_steps=(1, 1))
    record = clip.step()
    assert record["max_logit"] is not None and record["qk_clipped_heads"] == 0
    assert all(torch.equal(p, before[n]) for n, p in wrapped.named_parameters())


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("setting", "name"),
    [({"ns_steps": 0}, "ns_steps"), ({"ns_steps": 100}, "ns_steps"), ({"ns_steps": 2.5}, "ns_steps"),
     ({"momentum": 1.0}, "momentum"), ({"momentum": float("nan")}, "momentum"),
     ({"ns_coefficients": (3.4, -4.7)}, "ns_coefficients")],
    ids=["ns0", "ns100", "ns-float", "momentum1", "momentum-nan", "two-coefficients"],
)
def test_muon_refuses_bad_settings_at_construction_in_either_dtype(ns_dtype, setting, name):
    """ns_steps 0 and momentum 1 (updates of 0) used to train silently; ns_steps 100 ran in float32 (a CPU) and
    failed at the first bf16 step (a GPU); a float or two coefficients were tracebacks at the step."""
    param = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=name):
        Muon([param], lr=0.02, ns_dtype=ns_dtype, **setting)
    opt = Muon([param], lr=0.02, ns_dtype=ns_dtype)
    with pytest.raises(ValueError, match=name):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 4))], **setting})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_optim_config_refuses_ns_steps_torch_muon_cannot_run():
    assert OptimConfig(name="muon", muon_ns_steps=99).muon_ns_steps == 99
    with pytest.raises(ValueError, match=r"optim.muon_ns_steps must be an integer in \[1, 99\]"):
        OptimConfig(name="muon", muon_ns_steps=100)


def test_muon_takes_the_diagonal_injections_adapter_matrix():
    """Parcae's injection keeps its adapter map B [h, h] as a bare parameter: it went to AdamW's "embeddings"
    group, while the concat adapter (an nn.Linear) and every block matrix went to Muon (docs: "block and adapter
    matrices"). Its gains A_log / dt_bias stay with AdamW, without weight decay."""
    from recurrent_depth.train.optim import build_optimizers

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", injection="diagonal"))
    optimizers = build_optimizers(model, OptimConfig.from_preset("demo-muon", muon_ns_dtype="float32"))
    names = {g["name"]: set(g["param_names"]) for g in optimizers.param_groups}
    assert "transformer.adapter.B" in names["matrices"]
    assert not any(n.startswith("transformer.adapter.") for n in names["embeddings"])
    assert {"transformer.adapter.A_log", "transformer.adapter.dt_bias"} <= names["no_decay"]
    muon = optimizers.optimizers[0]
    assert isinstance(muon, Muon) and any(p is model.transformer.adapter.B for p in muon.param_groups[0]["params"])
