"""Record `official_59e0b69_extra.json`: official calls that `official_59e0b69.json` does not cover.

- `length-*`: how the official loops (`generate_minimal`, `generate_with_adaptive_compute`,
  `generate_speculative`) size a run from `max_new_tokens` / `max_length`, given as kwargs or on the
  `GenerationConfig` (they read `max_new_tokens` from the kwargs only, cap it by a `max_length` kwarg, and
  otherwise run `max_length - prompt` tokens, transformers 4.56's default `max_length` being 20);
- `random-s0-*`: the official default `init_scale=1.0` (a random s_0 at every forward, from torch's global
  RNG) after `torch.manual_seed(seed)`, on the adaptive, fixed-depth, transformers and speculative paths,
  batch 1 and (fixed depth, latest-m4 adaptive) a batch of two;
- `sample-*`: `do_sample=True` with temperature / top_k / top_p / min_p on the generation config after
  `torch.manual_seed(seed)` in `generate_minimal` and `generate_with_adaptive_compute` (their own
  `_sample_next_token`: one `torch.multinomial` per token, top-k 50 when unset, top-p dropping the token that
  crosses p), at init_scale 0 (whose s_0 draw still runs) and 1.0;
- `cosine-above-2-*`: a cosine threshold no angle reaches at init_scale 0, where the first check's 0/0 is NaN.

The model is `tests/official_golden_support.py`'s seeded one (its config's init_scale set to the official
1.0, which changes no weight). Run as `record_official.py` (same scratch Python with transformers 4.56 and
an official checkout at 59e0b69):

    OMP_NUM_THREADS=1 PYTHONPATH=src python tests/golden/record_official_extra.py record \\
        --official /tmp/official --python /tmp/official/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_official import GENERATION_CONFIG, PROMPTS, REVISION, REVISION_FULL, _import_official  # noqa: E402

OUT = Path(__file__).parent / f"official_{REVISION}_extra.json"
BATCH = [PROMPTS[0], PROMPTS[2][:5]]  # two prompts of one length (the official loops take no padding)
LOOPS = {
    "minimal": {"num_steps": 2, "continuous_compute": False, "init_scale": 0.0},
    "adaptive": {"num_steps": 3, "criterion": "kl", "init_scale": 0.0},
    "speculative": {"num_steps": 4, "draft_steps": 1, "lookahead_for_draft": 3, "init_scale": 0.0},
}
LENGTHS = {  # (kwargs, generation config fields)
    "config-max-new-tokens": ({}, {"max_new_tokens": 6}),
    "config-max-length-kwarg-max-new-tokens": ({"max_new_tokens": 9}, {"max_length": 12}),
    "kwarg-max-length": ({"max_length": 14}, {}),
    "none": ({}, {}),
    "kwarg-max-length-below-prompt": ({"max_length": 3}, {}),
    "kwargs-both-max-length-caps": ({"max_length": 14, "max_new_tokens": 20}, {}),
    "kwargs-both-max-new-tokens-caps": ({"max_length": 14, "max_new_tokens": 6}, {}),
    "config-both": ({}, {"max_length": 14, "max_new_tokens": 6}),
}


def _case(name: str, prompts: list[list[int]], kwargs: dict[str, Any], config: dict[str, Any] | None = None,
          seed: int | None = None, batch: bool = False) -> dict[str, Any]:
    return {"name": name, "prompts": prompts, "batch": batch, "seed": seed, "kwargs": kwargs,
            "generation_config": {**GENERATION_CONFIG, **(config or {})}}


def cases() -> list[dict[str, Any]]:
    out = []
    for loop, base in LOOPS.items():
        for label, (kwargs, config) in LENGTHS.items():
            out.append(_case(f"length-{loop}-{label}", [PROMPTS[0], PROMPTS[2]], {**base, **kwargs}, config))
    # one prompt per call (they take turns), to keep the test fast
    adaptive = {"num_steps": 16, "max_new_tokens": 8}
    random_s0: list[tuple[str, dict[str, Any]]] = [
        (f"adaptive-{criterion}", {**adaptive, "criterion": criterion})
        # (not minp-kl: its statistic jumps where a probability crosses 0.1 x the top one, so logits that differ
        # in the last bit, as a random s_0's do, can move an exit)
        for criterion in ("entropy-diff", "latent-diff", "kl", "argmax-stability", "cosine")
    ]
    random_s0 += [
        ("adaptive-kl-continuous", {**adaptive, "criterion": "kl", "continuous_compute": True}),
        ("adaptive-kl-latest-m4-no-exit-in-prefill",
         {**adaptive, "criterion": "kl", "cache_lookup_strategy": "latest-m4", "do_not_exit_in_prefill": True}),
        ("adaptive-kl-skip-min-steps-3-every-2",
         {**adaptive, "criterion": "kl", "cache_lookup_strategy": "skip", "min_steps": 3,
          "check_criterion_every_n_steps": 2}),
        ("adaptive-entropy-diff-init-0.5", {**adaptive, "criterion": "entropy-diff", "init_scale": 0.5}),
        ("generate-minimal-r2", {"num_steps": 2, "continuous_compute": False, "max_new_tokens": 8}),
        ("generate-minimal-continuous-r3", {"num_steps": 3, "continuous_compute": True, "max_new_tokens": 8}),
        ("hf-generate-r2", {"num_steps": 2, "max_new_tokens": 8}),
    ]
    for lookup in ("latest-m4", "compress-s4"):
        for threshold in (1, 0.5):
            random_s0.append((f"speculative-{lookup}-v{threshold}",
                              {"num_steps": 8, "draft_steps": 3, "lookahead_for_draft": 4,
                               "verification_threshold": threshold, "cache_lookup_strategy": lookup,
                               "max_new_tokens": 8}))
    random_s0.append(("speculative-default-steps", {"draft_steps": 4, "max_new_tokens": 8}))
    for i, (name, kwargs) in enumerate(random_s0):
        out.append(_case(f"random-s0-{name}", [PROMPTS[i % len(PROMPTS)]], kwargs, seed=i))
    # the verify pass draws its own s_0 and reruns all steps: the drafts' states would change this run's tokens
    out.append(_case("random-s0-speculative-draft2-lookahead3-v0.5", [PROMPTS[2]],
                     {"num_steps": 6, "draft_steps": 2, "lookahead_for_draft": 3, "verification_threshold": 0.5,
                      "max_new_tokens": 12}, seed=2))
    batch = {"max_new_tokens": 8}
    for name, kwargs in (("generate-minimal-r2", {"num_steps": 2, "continuous_compute": False}),
                         ("generate-minimal-continuous-r2", {"num_steps": 2, "continuous_compute": True}),
                         ("adaptive-none-continuous-r2", {"num_steps": 2, "criterion": "none",
                                                          "continuous_compute": True}),
                         ("hf-generate-r2", {"num_steps": 2}),
                         ("adaptive-kl-latest-m4-no-exit-in-prefill",
                          {"num_steps": 16, "criterion": "kl", "cache_lookup_strategy": "latest-m4",
                           "do_not_exit_in_prefill": True})):
        out.append(_case(f"random-s0-batch-{name}", BATCH, {**batch, **kwargs}, seed=10, batch=True))
    samplers = {"temperature": {"temperature": 0.7}, "top-k": {"top_k": 5}, "top-p": {"top_p": 0.8, "temperature": 1.3},
                "min-p": {"min_p": 0.2}, "all": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05}}
    paths = {"minimal-r4": {"num_steps": 4, "continuous_compute": False},
             "adaptive-kl": {"num_steps": 16, "criterion": "kl"}}
    for i, (label, sampler) in enumerate(samplers.items()):
        for path, kwargs in paths.items():
            out.append(_case(f"sample-{path}-{label}-init-0", [PROMPTS[i % len(PROMPTS)]],
                             {**kwargs, "init_scale": 0.0, "max_new_tokens": 8}, {"do_sample": True, **sampler},
                             seed=5 + i))
    for path, kwargs in paths.items():
        out.append(_case(f"sample-{path}-all-init-1", [PROMPTS[1]], {**kwargs, "max_new_tokens": 8},
                         {"do_sample": True, **samplers["all"]}, seed=8))
    out.append(_case("sample-batch-minimal-r4-all-init-0", BATCH,
                     {**paths["minimal-r4"], "init_scale": 0.0, "max_new_tokens": 8},
                     {"do_sample": True, **samplers["all"]}, seed=11, batch=True))
    out.append(_case("cosine-above-2-init-0", [PROMPTS[0], PROMPTS[2]],
                     {"num_steps": 16, "criterion": "cosine", "exit_threshold": 5.0, "init_scale": 0.0,
                      "max_new_tokens": 8}))
    return out


def calls(case: dict[str, Any]) -> list[list[list[int]]]:
    """The input_ids of each call: the batch at once, or each prompt alone."""
    return [case["prompts"]] if case["batch"] else [[p] for p in case["prompts"]]


def worker(checkout: Path, model_dir: Path, cases_file: Path, out_file: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    torch.set_num_threads(1)
    official = _import_official(checkout)
    model = official.RavenForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    results = []
    for case in json.loads(cases_file.read_text()):
        runs = []
        for ids in calls(case):
            if case["seed"] is not None:
                torch.manual_seed(case["seed"])
            ids_t = torch.tensor(ids)
            out = model.generate(ids_t, GenerationConfig(**case["generation_config"]), **case["kwargs"])
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            runs.append(sequences[:, ids_t.shape[1]:].tolist())
        results.append({**case, "tokens": runs})
    meta = {"torch": torch.__version__, "transformers": transformers.__version__}
    out_file.write_text(json.dumps({"environment": meta, "cases": results}))


def record(checkout: Path, python: str, out: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import tests.official_golden_support as support

    spec = json.loads(json.dumps(support.MODEL_SPEC))
    spec["config"]["init_scale"] = 1.0  # the official forward's default (no weight changes)
    model = support.build_golden_model(spec)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        support.write_official_dir(model, tmp_path / "model")
        (tmp_path / "cases.json").write_text(json.dumps(cases()))
        subprocess.run([python, __file__, "worker", "--official", str(checkout), "--model-dir",
                        str(tmp_path / "model"), "--cases", str(tmp_path / "cases.json"),
                        "--out", str(tmp_path / "out.json")], check=True)
        recorded = json.loads((tmp_path / "out.json").read_text())
    golden = {
        "official": {"repository": "seal-rg/recurrent-pretraining", "revision": REVISION_FULL,
                     "file": "recpre/raven_modeling_minimal.py", **recorded["environment"]},
        "how": ("torch.manual_seed(seed) when seed is set, then model.generate(torch.tensor(ids), "
                "GenerationConfig(**generation_config), **kwargs) on the official RavenForCausalLM (fp32) loaded "
                "from the model below written as an official checkpoint; ids = the batch (batch: true) or each "
                "prompt alone; tokens = the new tokens of each call, per row."),
        "model": {**spec, "state_dict_sha256": support.state_dict_sha256(model)},
        "cases": recorded["cases"],
    }
    out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out}: {len(golden['cases'])} cases")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["record", "worker"])
    parser.add_argument("--official", type=Path)
    parser.add_argument("--python")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cases", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.official, args.model_dir, args.cases, args.out)
    elif args.official is None or args.python is None:
        parser.error("record needs --official and --python")
    else:
        record(args.official, args.python, args.out)


if __name__ == "__main__":
    main()
