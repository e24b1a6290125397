"""The seeded tiny model of Huginn's layout behind `tests/golden/official_59e0b69.json`.

The golden file holds tokens that the official implementation (seal-rg/recurrent-pretraining at
59e0b69, `recpre/raven_modeling_minimal.py`) generated from this model; `tests/golden/record_official.py`
re-records it. The weights are not checked in (the 65536 x 64 embedding alone is 16 MB in fp32):
`build_golden_model` rebuilds them from the spec stored in the golden file, and the file's
`state_dict_sha256` proves the rebuild is the model that was recorded.

The weights are drawn here, not by `RecurrentDepthLM`'s initializer, so that a change to our init
does not invalidate the golden file. The recipe is chosen so adaptive exit is exercised: the
adapter's state half is scaled down (`adapter_state_gain`), which makes the recurrence contract,
so criteria exit after a few steps and at different steps for different tokens. Token X's
embedding row, scaled by `end_turn_scale`, is copied into `<|end_turn|>`'s row (`end_turn_alias`): where the model
would emit X it emits end of turn instead, which exercises the official code's hard-coded stops.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

import recurrent_depth as rd
from recurrent_depth.checkpoint import save_official_layout

GOLDEN_PATH = Path(__file__).parent / "golden" / "official_59e0b69.json"

END_TURN = 65508

MODEL_SPEC: dict[str, Any] = {
    "seed": 17,
    "config": dict(
        vocab_size=65536, hidden_size=64, num_heads=4, intermediate_size=128, prelude_layers=2,
        core_layers=4, coda_layers=2, mean_recurrence=8, mean_backprop_depth=4, max_seq_len=256,
        bos_token_id=65504, eos_token_id=65505, pad_token_id=65509, init_scale=0.0,
    ),
    # Every parameter, in sorted name order, from one torch.Generator(seed):
    "recipe": dict(
        linear_gain=1.0,          # Linear weights ~ N(0, gain^2 / fan_in)
        adapter_state_gain=0.3,   # then adapter.weight[:, :h] (the state half) *= this
        norm_jitter=0.1,          # RMSNorm weights ~ 1 + N(0, jitter^2)
        ln_f_jitter=0.5,          # ln_f's, so that ln_f(s) and s differ (the two warm-start sources)
        qk_bias_std=0.1,
        embedding_std=0.1,
        end_turn_alias=59330,     # wte[65508] := end_turn_scale * wte[59330]
        end_turn_scale=1.05,
    ),
}


def build_golden_model(spec: dict[str, Any] = MODEL_SPEC) -> rd.RecurrentDepthLM:
    """The fp32 model of `spec` (the golden file's `model` entry), in eval mode."""
    config = rd.ModelConfig(**spec["config"])
    recipe = spec["recipe"]
    model = rd.RecurrentDepthLM(config).eval()
    generator = torch.Generator().manual_seed(spec["seed"])
    h = config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            draw = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name == "transformer.ln_f.weight":
                param.copy_(1 + recipe["ln_f_jitter"] * draw)
            elif "norm" in name:
                param.copy_(1 + recipe["norm_jitter"] * draw)
            elif name.endswith("qk_bias"):
                param.copy_(recipe["qk_bias_std"] * draw)
            elif name == "transformer.wte.weight":
                param.copy_(recipe["embedding_std"] * draw)
                param[END_TURN] = recipe["end_turn_scale"] * param[recipe["end_turn_alias"]]
            else:
                param.copy_(recipe["linear_gain"] / math.sqrt(param.shape[1]) * draw)
                if name == "transformer.adapter.weight":
                    param[:, :h] *= recipe["adapter_state_gain"]
    return model


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, shape, fp32 bytes) of every state-dict tensor, in sorted name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to(torch.float32).contiguous().cpu()
        digest.update(f"{name}:{list(data.shape)};".encode())
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def write_official_dir(model: rd.RecurrentDepthLM, path: Path) -> None:
    """`model` (fp32) as an official Huginn directory: what `rdepth export --official-layout` writes
    (`save_official_layout`), which tests/golden/check_official_layout.py runs with the official code."""
    save_official_layout(model, path)


def load_golden() -> dict[str, Any]:
    return json.loads(GOLDEN_PATH.read_text())
