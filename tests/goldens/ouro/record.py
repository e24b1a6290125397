"""Record the Ouro goldens in this directory from Ouro's REFERENCE modeling file. NOT a test.

This script runs only in a scratch environment, never in the project's: it imports torch, transformers
4.x (4.57.6 was used) and the reference `modeling_ouro.py`, which this project never ships or imports.
pytest does not collect it (its name does not match test_*.py). Setup, as used (README.md has details):

    git -C <mirror of Eagle4398/ouro-nixpkgs> show 3a65f3f:modeling_ouro.py > /tmp/modeling_ouro.py
    python3 -m venv /work/scratch/ouro-env && . /work/scratch/ouro-env/bin/activate
    pip install torch==2.13.0 "transformers==4.57.6" safetensors
    OMP_NUM_THREADS=1 python tests/goldens/ouro/record.py --modeling /tmp/modeling_ouro.py

For each case it builds the reference OuroForCausalLM from `configuration_ouro.OuroConfig` (beside this
file), sets every parameter to seeded random values rounded to bfloat16, writes the model directory
(config.json, generation_config.json, model.safetensors in bfloat16, as the released checkpoints store
them), reloads it in float32 with eager attention, and writes `expected.safetensors` into the same
directory. Every expected tensor comes out of the reference code: the exit pdf and the exit steps are
captured from inside OuroForCausalLM.forward (its torch.cumsum and torch.gather calls), not recomputed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
MODELING_REPO = "Eagle4398/ouro-nixpkgs"
MODELING_COMMIT = "3a65f3f844c280bb5f2713614d499b845f4f06b1"
MODELING_SHA256 = "804806c2efcd041a63874ef7f4767081a4467b0a1665cb9e386fc70db724f84a"
# What the released checkpoints' config.json names (ByteDance/Ouro-1.4B and -2.6B).
AUTO_MAP = {
    "AutoConfig": "configuration_ouro.OuroConfig",
    "AutoModel": "modeling_ouro.OuroModel",
    "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
}
EXIT_AT_STEP = 1

CASES: dict[str, dict[str, Any]] = {
    # GQA, untied head, the default rope; ids 0 (= pad_token_id, the embedding's padding_idx) appear in row 1.
    "config_a": {
        "seed": 20251031,
        "gate_bias": -1.1,
        "config": {
            "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 2, "attention_dropout": 0.0, "total_ut_steps": 4, "early_exit_threshold": 1.0,
            "use_cache": True, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        },
        "input_ids": [[17, 3, 99, 42, 127, 8, 64], [0, 5, 5, 120, 33, 0, 2]],
    },
    # MHA, tied embeddings, linear rope scaling (factor 2) on theta 1e6, eps 1e-5, no pad id.
    "config_b": {
        "seed": 20251101,
        "gate_bias": -0.8,
        "config": {
            "vocab_size": 100, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu",
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 3, "attention_dropout": 0.0, "total_ut_steps": 3, "early_exit_threshold": 1.0,
            "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
        },
        "input_ids": [[1, 57, 23, 99, 4, 88, 10], [2, 2, 61, 0, 35, 77, 14]],
    },
}


def import_reference(modeling: Path, workdir: Path) -> Any:
    """Import the reference as package `ouro_ref` (it imports `.configuration_ouro`, so it needs one)."""
    digest = hashlib.sha256(modeling.read_bytes()).hexdigest()
    if digest != MODELING_SHA256:
        raise SystemExit(f"{modeling}: sha256 {digest}, expected {MODELING_SHA256} ({MODELING_REPO}@{MODELING_COMMIT})")
    package = workdir / "ouro_ref"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(modeling, package / "modeling_ouro.py")
    shutil.copy(HERE / "configuration_ouro.py", package / "configuration_ouro.py")
    sys.path.insert(0, str(workdir))
    import ouro_ref.modeling_ouro as modeling_module

    return modeling_module


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int, gate_bias: float) -> None:
    """Seeded values for every parameter, none trivially 0 or 1, each rounded to bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight") or "layernorm" in name:
            value = 1.0 + 0.2 * noise
        elif name == "model.early_exit_gate.bias":
            value = gate_bias + 0.05 * noise
        elif name == "model.early_exit_gate.weight":
            value = noise * (0.8 / hidden**0.5)
        elif name == "model.embed_tokens.weight":
            value = 0.5 * noise
        else:  # q/k/v/o, gate/up/down, an untied lm_head: unit-variance outputs
            value = noise / param.shape[1] ** 0.5
        param.copy_(value.to(torch.bfloat16).float())


@contextlib.contextmanager
def captured(calls: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Record what OuroForCausalLM.forward passes to torch.cumsum (the exit pdf) and torch.gather (exit steps)."""
    cumsum, gather = torch.cumsum, torch.gather

    def spy_cumsum(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.setdefault("pdf", []).append(tensor.detach().clone())
        return cumsum(tensor, *args, **kwargs)

    def spy_gather(tensor: torch.Tensor, dim: int, index: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if index.dim() == 4:
            calls.setdefault("exit_steps", []).append(index[..., 0, 0].detach().clone())
        return gather(tensor, dim, index, *args, **kwargs)

    torch.cumsum, torch.gather = spy_cumsum, spy_gather
    try:
        yield
    finally:
        torch.cumsum, torch.gather = cumsum, gather


def only(calls: dict[str, list[torch.Tensor]], kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The one captured call of `kind` with `shape` (other library code may call the same functions)."""
    matching = [t for t in calls.get(kind, []) if tuple(t.shape) == shape]
    assert len(matching) == 1, (kind, shape, [tuple(t.shape) for t in calls.get(kind, [])])
    return matching[0]


def pick_threshold(pdf: torch.Tensor) -> float:
    """The q on a 0.01 grid whose exits (the reference's rule) spread over the most steps, farthest from a tie."""
    cumulative = torch.cumsum(pdf.double(), dim=2)
    steps = pdf.shape[2]
    best: tuple[int, float, float] | None = None
    for q in [i / 100 for i in range(5, 96)]:
        reached = cumulative >= q
        exits = torch.where(reached.any(dim=2), reached.double().argmax(dim=2), steps - 1)
        margin = (cumulative - q).abs().min().item()
        score = (len(torch.unique(exits)), margin, q)
        if best is None or score[:2] > best[:2]:
            best = score
    assert best is not None
    if best[0] < min(3, steps) or best[1] < 1e-3:
        raise SystemExit(f"no threshold separates the exits well: {best}")
    return best[2]


def write_model_dir(model: torch.nn.Module, out: Path) -> None:
    """save_pretrained in bfloat16, then config.json as transformers 4.54 (the version Ouro names) writes it."""
    if out.exists():
        shutil.rmtree(out)
    model.config.auto_map = dict(AUTO_MAP)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    config = json.loads((out / "config.json").read_text())
    if "dtype" in config:  # 4.56+ writes "dtype"; the released files (4.5x) say "torch_dtype"
        config["torch_dtype"] = config.pop("dtype")
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")


def record_case(reference: Any, name: str, case: dict[str, Any]) -> dict[str, Any]:
    out = HERE / name
    config = reference.OuroConfig(**case["config"])
    model = reference.OuroForCausalLM._from_config(config, attn_implementation="eager")
    randomise(model, case["seed"], case["gate_bias"])
    write_model_dir(model, out)
    built = {k: v.clone() for k, v in model.state_dict().items()}

    # set_attn_implementation refuses this remote-code class, so each implementation is its own load.
    model, sdpa_model = (reference.OuroForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=impl)
                         .eval() for impl in ("eager", "sdpa"))
    assert (model.config._attn_implementation, sdpa_model.config._attn_implementation) == ("eager", "sdpa")
    for key, value in model.state_dict().items():  # what the file holds is what produced the goldens
        assert torch.equal(value, built[key]), key
    stored = load_file(out / "model.safetensors")
    assert config.tie_word_embeddings == ("lm_head.weight" not in stored), sorted(stored)

    input_ids = torch.tensor(case["input_ids"])
    seq = input_ids.shape[1]
    expected: dict[str, torch.Tensor] = {"input_ids": input_ids}
    with torch.no_grad():
        _, hidden_list, gate_list = model.model(input_ids=input_ids, use_cache=False)
        expected["per_step_logits"] = torch.stack([model.lm_head(h) for h in hidden_list])
        expected["gate_logits"] = torch.stack([g.squeeze(-1) for g in gate_list])

        calls: dict[str, list[torch.Tensor]] = {}
        with captured(calls):
            default = model(input_ids=input_ids, use_cache=False).logits
        steps = config.total_ut_steps
        expected["exit_pdf"] = only(calls, "pdf", (*input_ids.shape, steps))  # [B, S, T], stacked on dim 2
        expected["default_exit_steps"] = only(calls, "exit_steps", tuple(input_ids.shape))
        q = pick_threshold(expected["exit_pdf"])
        calls = {}
        with captured(calls):
            expected["threshold_logits"] = model(input_ids=input_ids, use_cache=False, exit_threshold=q).logits
        expected["threshold_exit_steps"] = only(calls, "exit_steps", tuple(input_ids.shape))
        expected["exit_threshold"] = torch.tensor(q, dtype=torch.float64)
        expected["exit_at_step_logits"] = model(input_ids=input_ids, use_cache=False, exit_at_step=EXIT_AT_STEP).logits
        expected["exit_at_step"] = torch.tensor(EXIT_AT_STEP)

        # Decode: prefill S-2 tokens, then one token at a time through the reference's UniversalTransformerCache.
        decode_impl, eager_error = "eager", ""
        try:
            decode = run_decode(model, input_ids, reference)
        except RuntimeError as error:  # the reference's get_mask_sizes under-counts keys while decoding (eager)
            decode_impl, eager_error = "sdpa", str(error).splitlines()[0]
            decode = run_decode(sdpa_model, input_ids, reference)
        expected.update(decode)

        _, sdpa_hidden, _ = sdpa_model.model(input_ids=input_ids, use_cache=False)
        sdpa_logits = torch.stack([sdpa_model.lm_head(h) for h in sdpa_hidden])

    # Consistency of the recorded tensors with one another (the reference's own paths must agree).
    per_step = expected["per_step_logits"]
    gathered = per_step.permute(1, 2, 0, 3).gather(
        2, expected["threshold_exit_steps"][..., None, None].expand(-1, -1, 1, per_step.shape[-1])).squeeze(2)
    assert torch.equal(gathered, expected["threshold_logits"])
    assert torch.equal(expected["exit_at_step_logits"], per_step[EXIT_AT_STEP])
    default_gathered = per_step.permute(1, 2, 0, 3).gather(
        2, expected["default_exit_steps"][..., None, None].expand(-1, -1, 1, per_step.shape[-1])).squeeze(2)
    assert torch.equal(default_gathered, default)
    full_last = per_step[-1]
    decoded = torch.cat([expected["decode_prefill_logits"], expected["decode_step1_logits"],
                         expected["decode_step2_logits"]], dim=1)
    decode_diff = (decoded - full_last).abs().max().item()
    sdpa_diff = (sdpa_logits - per_step).abs().max().item()
    assert decode_diff < 1e-4 and sdpa_diff < 1e-4, (decode_diff, sdpa_diff)

    facts = {
        "case": name,
        "seed": str(case["seed"]),
        "gate_bias_mean": str(case["gate_bias"]),
        "exit_threshold": repr(q),
        "exit_at_step": str(EXIT_AT_STEP),
        "attn_implementation": "eager",
        "decode_attn_implementation": decode_impl,
        "decode_eager_error": eager_error,
        "dtype": "float32 compute from bfloat16-stored weights",
        "max_abs_diff_sdpa_vs_eager_per_step_logits": repr(sdpa_diff),
        "max_abs_diff_cached_decode_vs_full_last_step": repr(decode_diff),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "modeling": f"{MODELING_REPO}@{MODELING_COMMIT}:modeling_ouro.py sha256={MODELING_SHA256}",
        "prefill_tokens": str(seq - 2),
    }
    tensors = {k: v.contiguous() for k, v in expected.items()}
    # One metadata key: safetensors writes a metadata map in no fixed order, and the file should not change on rerun.
    save_file(tensors, out / "expected.safetensors", metadata={"facts": json.dumps(facts, sort_keys=True)})
    return {**facts, "threshold_exit_steps": expected["threshold_exit_steps"].tolist(),
            "default_exit_steps": expected["default_exit_steps"].tolist(),
            "exit_pdf_min_max": [expected["exit_pdf"].min().item(), expected["exit_pdf"].max().item()],
            "sizes": {p.name: p.stat().st_size for p in sorted(out.iterdir())}}


def run_decode(model: torch.nn.Module, input_ids: torch.Tensor, reference: Any) -> dict[str, torch.Tensor]:
    seq = input_ids.shape[1]
    first = model(input_ids=input_ids[:, : seq - 2], use_cache=True)
    cache = first.past_key_values
    assert isinstance(cache, reference.UniversalTransformerCache), type(cache)
    second = model(input_ids=input_ids[:, seq - 2 : seq - 1], past_key_values=cache, use_cache=True)
    third = model(input_ids=input_ids[:, seq - 1 :], past_key_values=second.past_key_values, use_cache=True)
    return {"decode_prefill_logits": first.logits, "decode_step1_logits": second.logits,
            "decode_step2_logits": third.logits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modeling", type=Path, default=Path("/tmp/modeling_ouro.py"))
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        reference = import_reference(args.modeling, Path(workdir))
        for name in args.case or sorted(CASES):
            print(json.dumps(record_case(reference, name, CASES[name]), indent=1))


if __name__ == "__main__":
    main()
