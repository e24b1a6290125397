"""Check that `rdepth export --official-layout` writes directories the official Huginn code loads and runs.

Never imported by the test suite. Run by hand, with the official checkout and the scratch Python that
`record_official.py`'s docstring sets up (seal-rg/recurrent-pretraining at 59e0b69, torch + transformers 4.56):

    OMP_NUM_THREADS=1 PYTHONPATH=src python tests/golden/check_official_layout.py \\
        --official /tmp/official --python /tmp/official/venv/bin/python

`check` builds the golden tiny model (tests/official_golden_support.py), saves it in the library's layout and
exports it with our CLI in each of `VARIANTS` (config changes, dtypes, shards, with and without the official
code). A stand-in for the official download (config.json with the official auto_map, beside
`recpre/raven_config_minimal.py` and `recpre/raven_modeling_minimal.py` from the checkout) is what
`--official-code` copies. The `worker` (this file, run by `--python`; imports torch, transformers and the
official module only) loads each directory with the official code, reports transformers' loading info (missing,
unexpected and mismatched keys, and anything it logged at warning level), checks the loaded `freqs_cis` and the
tied head, and writes the forward logits of `PROMPTS` (num_steps 8, init_scale 0, i.e. s_0 = 0). `check` then
loads the same directory with `RecurrentDepthLM.from_pretrained` and prints the largest logit difference.

Measured (torch 2.13.0+cpu, transformers 4.56.2, Python 3.11.7, 1 thread; 3 prompts, logits [T, 65536]):
- every directory: no missing, unexpected or mismatched keys and nothing logged at warning level; freqs_cis loads
  as float32 [1, 256, 1, 8, 2], equal to the official `_precompute_freqs_cis()`; the head tied unless untied;
- max |official - ours| = 0 (bit-identical) for float32, float32 in 4 shards, float32 without --official-code
  (the class imported directly), untied head, qk_bias off, rope_base 1234 / norm_eps 1e-3; also 0 for the
  bfloat16 export loaded by both in bfloat16 (0.359 from the fp32 model's) and loaded by both in float32 (0.262);
- bfloat16 with torch_dtype="auto": the official side runs in float32, not the config's bfloat16 (RavenConfig
  passes no dtype to PretrainedConfig, so transformers takes the first floating tensor's dtype: freqs_cis,
  float32, as huginn-0125.md §2 lists it for the official download too), ours in bfloat16: 0.259 apart, a
  dtype difference, not a layout one;
- bias=True is refused (exit 2, nothing written): the official code has a bias on the adapter only; before the
  refusal it dropped the 32 attention / MLP biases (transformers warned "Some weights ... were not used") and its
  logits differed from ours by 2.29 on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = [
    [11, 2000, 30000, 42, 7],
    [65504, 500, 501, 502, 503, 504, 60000, 12345],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8],
]
NUM_STEPS = 8
AUTO_MAP = {"AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"}
# name -> (changes to the golden model's config, rdepth export flags, how the worker loads it, the dtype both sides
# load it in). how "auto" = AutoModelForCausalLM with trust_remote_code (what --official-code is for), "direct" = the
# official class imported from the checkout. dtype "auto": transformers' torch_dtype="auto" on the official side, as
# stored on ours.
CODE = ["--official-code", "{code}"]
VARIANTS: dict[str, tuple[dict[str, Any], list[str], str, str]] = {
    "float32": ({}, CODE, "auto", "auto"),
    "bfloat16": ({}, ["--dtype", "bfloat16", *CODE], "auto", "bfloat16"),
    "bfloat16-as-float32": ({}, ["--dtype", "bfloat16", *CODE], "auto", "float32"),
    "bfloat16-auto": ({}, ["--dtype", "bfloat16", *CODE], "auto", "auto"),
    "float32-sharded": ({}, ["--max-shard-mb", "6", *CODE], "auto", "auto"),
    "float32-no-code": ({}, [], "direct", "auto"),
    "untied": ({"tie_embeddings": False}, CODE, "auto", "auto"),
    "no-qk-bias": ({"qk_bias": False}, CODE, "auto", "auto"),
    "rope-base-norm-eps": ({"rope_base": 1234.0, "norm_eps": 1e-3}, CODE, "auto", "auto"),
}
# Models the export must refuse (rdepth exits 2 with one line), as the official code would run another model.
REFUSED = {"bias": {"bias": True}}
# transformers' notice about RavenConfig's own `self.torch_dtype = ...` (the official download triggers it too).
DEPRECATION = "`torch_dtype` is deprecated! Use `dtype` instead!"


# ---------------------------------------------------------------------------------------------
# worker: runs in the scratch Python; imports torch, transformers and the official module only


def worker(checkout: Path, model_dir: Path, how: str, dtype_name: str, out_file: Path) -> None:
    """Load `model_dir` with the official code; write its loading report (json) and logits (.logits.pt)."""
    import logging

    import torch
    import transformers

    torch.set_num_threads(1)
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() != DEPRECATION:
                logged.append(record.getMessage())

    transformers.logging.set_verbosity_warning()
    transformers.logging.get_logger().addHandler(Keep(logging.WARNING))
    dtype = dtype_name if dtype_name == "auto" else getattr(torch, dtype_name)
    if how == "auto":
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, trust_remote_code=True, torch_dtype=dtype, output_loading_info=True)
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from record_official import _import_official

        official = _import_official(checkout)
        model, info = official.RavenForCausalLM.from_pretrained(model_dir, torch_dtype=dtype,
                                                                  output_loading_info=True)
    model.eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p]), num_steps=NUM_STEPS, init_scale=0.0).logits[0] for p in PROMPTS]
    torch.save(logits, out_file.with_suffix(".logits.pt"))
    report = {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "param_dtype": str(model.transformer.wte.weight.dtype),
        "missing": list(info["missing_keys"]), "unexpected": list(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info["mismatched_keys"]], "errors": list(info["error_msgs"]),
        "logged": logged,
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "freqs_cis": {"dtype": str(model.freqs_cis.dtype), "shape": list(model.freqs_cis.shape),
                      "equals_official_table": bool(torch.equal(model.freqs_cis.float(),
                                                                model._precompute_freqs_cis()))},
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": sys.version.split()[0]},
    }
    out_file.write_text(json.dumps(report))


# ---------------------------------------------------------------------------------------------
# check: runs with our environment


def write_code_dir(checkout: Path, path: Path) -> None:
    """What `--official-code` reads: an official download's config.json (its auto_map) and modeling files."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "huginn_raven", "auto_map": AUTO_MAP}))
    for name in ("raven_config_minimal.py", "raven_modeling_minimal.py"):
        shutil.copy(checkout / "recpre" / name, path / name)


def _logits(model: Any) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(torch.tensor([p]), num_steps=NUM_STEPS, init_scale=0.0).logits[0] for p in PROMPTS]


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def check(checkout: Path, python: str) -> None:
    import torch

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import tests.official_golden_support as support

    import recurrent_depth as rd
    from recurrent_depth.checkpoint import weight_files
    from recurrent_depth.cli import main as rdepth

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_code_dir(checkout, tmp_path / "code")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
        for name, changes in REFUSED.items():
            config = rd.ModelConfig(**{**support.MODEL_SPEC["config"], **changes})  # (our init: never run)
            rd.RecurrentDepthLM(config).save_pretrained(tmp_path / name)
            code = rdepth(["export", "--model", str(tmp_path / name), "--out", str(tmp_path / f"{name}-out"),
                           "--official-layout"])
            print(f"{name}: rdepth export --official-layout exits {code} (2 = refused, nothing written: "
                  f"{not (tmp_path / f'{name}-out').exists()})")
        for name, (changes, flags, how, dtype) in VARIANTS.items():
            spec = {**support.MODEL_SPEC, "config": {**support.MODEL_SPEC["config"], **changes}}
            model = support.build_golden_model(spec)
            source, out = tmp_path / f"{name}-source", tmp_path / name
            model.save_pretrained(source)
            args = ["export", "--model", str(source), "--out", str(out), "--official-layout"]
            assert rdepth(args + [f.format(code=tmp_path / "code") for f in flags]) == 0
            subprocess.run([python, __file__, "worker", "--official", str(checkout), "--model-dir", str(out),
                            "--how", how, "--dtype", dtype, "--out", str(tmp_path / f"{name}.json")],
                           check=True, env=env)
            report: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
            official = torch.load(tmp_path / f"{name}.logits.pt", weights_only=True)
            ours_model = rd.RecurrentDepthLM.from_pretrained(out, dtype=None if dtype == "auto" else dtype).eval()
            print(f"{name}: {len(weight_files(out))} weight file(s), config torch_dtype "
                  f"{json.loads((out / 'config.json').read_text())['torch_dtype']}, loaded by {report['class']} "
                  f"as {report['param_dtype']} (ours: {ours_model.transformer.wte.weight.dtype})")
            print(f"  missing {report['missing']} unexpected {report['unexpected']} mismatched "
                  f"{report['mismatched']} errors {report['errors']} logged {report['logged']}")
            print(f"  tied head {report['tied']}; freqs_cis {report['freqs_cis']}")
            print(f"  max |official - ours| logits on this directory: {_max_diff(_logits(ours_model), official):.3g}; "
                  f"official vs the fp32 model: {_max_diff(official, _logits(model)):.3g}")
        print(f"environment: {report['environment']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["check", "worker"], nargs="?", default="check")
    parser.add_argument("--official", type=Path, required=True, help="an official checkout (holds recpre/)")
    parser.add_argument("--python", help="the scratch Python with torch + transformers 4.56 (check)")
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--how", choices=["auto", "direct"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.official, args.model_dir, args.how, args.dtype, args.out)
    elif args.python is None:
        parser.error("check needs --python")
    else:
        check(args.official, args.python)


if __name__ == "__main__":
    main()
