"""Record `official_59e0b69.json`: what the official Huginn code generates on our seeded tiny model.

The official implementation (seal-rg/recurrent-pretraining, `recpre/raven_modeling_minimal.py`) is
never part of this project and never imported by it. This script runs it in a separate Python that
the user provides, importing the module from the checkout path given on the command line:

    git --git-dir=<mirror of seal-rg/recurrent-pretraining> archive 59e0b69 recpre | tar -x -C /tmp/official
    python3 -m venv /tmp/official/venv
    /tmp/official/venv/bin/pip install torch==2.13.0 "transformers>=4.56,<4.57"
    OMP_NUM_THREADS=1 PYTHONPATH=src python tests/golden/record_official.py record \\
        --official /tmp/official --python /tmp/official/venv/bin/python

`record` builds the model with our code (tests/official_golden_support.py), writes it as an official
checkpoint directory, runs this same file with `--python` in `worker` mode (which imports torch,
transformers and the official module only), measures the largest logit difference between the
official forward and ours (recorded; 0 when they agree bit for bit), and writes the JSON.
`compare` runs our `rd.generate` with each case's `ours_closest` options and prints which cases
already give the official tokens (agree: tokens and steps; tokens-agree: tokens only; prefix: ours
is a prefix of the official tokens, which ran past max_new_tokens; differ@i: the first different
token; no-option: we have no equivalent):

    OMP_NUM_THREADS=1 PYTHONPATH=src python tests/golden/record_official.py compare

Every case is called as the official model card does: `model.generate(input_ids, generation_config,
**kwargs)`, whose dispatcher picks the path (plain transformers generate, `generate_minimal`,
`generate_with_adaptive_compute` or `generate_speculative`); greedy, `init_scale=0.0` (s0 = 0),
batch 1, dynamic cache. Steps are counted by wrapping the model instance's `core_block_forward`
(one call = one recurrence step), with a new segment at each `forward` / `embed_inputs` call.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REVISION = "59e0b69"
REVISION_FULL = "59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6"
PROMPTS = [
    [11, 2000, 30000, 42, 7],
    [65504, 500, 501, 502, 503, 504, 60000, 12345],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8],
]
NEW_TOKENS = 14
FIXED_DEPTH = 8
ADAPTIVE_MAX = 16
END_TURN = 65508  # <|end_turn|>
OFFICIAL_STOPS = (65504, 65505, END_TURN)  # _get_stops: begin_text, end_text, end_turn (+ the config's eos)
GENERATION_CONFIG = {"do_sample": False, "bos_token_id": 65504, "eos_token_id": 65505, "pad_token_id": 65509}
# The official `"auto"` thresholds (EntropyDiff/LatentDiff/KL/MinKL/ArgmaxStability/Cosine evaluators).
AUTO = {"entropy-diff": 1e-3, "latent-diff": 0.03, "kl": 1e-3, "minp-kl": 1e-5, "argmax-stability": 5,
        "cosine": 1e-3}
OTHER = {"entropy-diff": 1e-2, "latent-diff": 0.1, "kl": 1e-2, "minp-kl": 1e-3, "argmax-stability": 3,
         "cosine": 1e-2}
LOOKUPS = ["full", "latest-m4", "available-m4", "always-last-m4", "skip", "compress-s4", "compress-s8",
           "compress-r4", "compress-anchor", "latest-m4-compress-s4", "latest-m4-compress-s16",
           "latest-m4-compress-anchor", "available-m4-compress-s16"]


def _case(name: str, kwargs: dict[str, Any], ours: dict[str, Any] | None, note: str,
          generation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    base = {"init_scale": 0.0, "max_new_tokens": NEW_TOKENS}
    ours_full = None if ours is None else {"init_scale": 0.0, "max_new_tokens": NEW_TOKENS, **ours}
    return {"name": name, "kwargs": {**base, **kwargs},
            "generation_config": {**GENERATION_CONFIG, **(generation_config or {})},
            "ours_closest": ours_full, "note": note}


def _ours_lookup(strategy: str) -> tuple[dict[str, Any] | None, str]:
    """Our current option nearest to an official lookup strategy (4 core layers)."""
    if "compress-s" in strategy:
        n = int(strategy.split("compress-s")[1])
        if n % 4:
            return None, "compress-sN with N not a multiple of the core depth has no kv_budget equivalent"
        budget = {"kv_budget": n // 4}
        if strategy.startswith("compress"):
            return budget, "kv_budget=N/4 shares slots as compress-sN; a token missing a slot is read at its deepest"
        return budget, "kv_budget=N/4 = compress-sN; our early-exit fallback = the deepest same-layer entry (latest-m4)"
    if strategy == "latest-m4":
        return {}, "our default: an early-exited token is read at its deepest same-layer entry"
    return None, f"no option of ours reads the cache as {strategy!r}"


def _criterion_variants() -> Iterator[tuple[str, str, Any, dict[str, Any] | None]]:
    """(criterion, label, official threshold, our closest options) at "auto" and at one other threshold."""
    for criterion in AUTO:
        for label, threshold in (("auto", "auto"), ("other", OTHER[criterion])):
            value = AUTO[criterion] if threshold == "auto" else threshold
            ours = None if criterion == "minp-kl" else {"num_steps": ADAPTIVE_MAX, "exit_criterion": criterion,
                                                        "exit_threshold": value}
            yield criterion, label, threshold, ours


def cases(stop_ids: list[int]) -> list[dict[str, Any]]:
    """Every recorded call. `stop_ids`: extra eos ids for the stop-token cases."""
    fixed = {"num_steps": FIXED_DEPTH}
    out = [
        _case("hf-generate-fixed-r8", fixed, fixed, "plain transformers generate, fixed depth"),
        _case("hf-generate-fixed-r3", {"num_steps": 3}, {"num_steps": 3}, "plain transformers generate, depth 3"),
        _case("hf-generate-fixed-r8-compress-s4", {**fixed, "cache_lookup_strategy": "compress-s4"},
              {**fixed, "kv_budget": 1}, "one KV slot per core layer = kv_budget 1"),
        _case("hf-generate-fixed-r8-compress-s8", {**fixed, "cache_lookup_strategy": "compress-s8"},
              {**fixed, "kv_budget": 2}, "compress-s8 = kv_budget 2"),
        _case("generate-minimal-fixed-r8", {**fixed, "continuous_compute": False}, fixed,
              "generate_minimal (dispatched by the continuous_compute kwarg), stops at 65504/65505/65508"),
        _case("generate-minimal-continuous-r8", {**fixed, "continuous_compute": True},
              {**fixed, "warm_start": True},
              "official warm start = the ln_f-normed last latent; ours = the raw final state"),
        _case("generate-minimal-fixed-r2", {"num_steps": 2, "continuous_compute": False}, {"num_steps": 2},
              "depth 2: the warm start still matters on this strongly contracting model"),
        _case("generate-minimal-continuous-r2", {"num_steps": 2, "continuous_compute": True},
              {"num_steps": 2, "warm_start": True},
              "official warm start = the ln_f-normed last latent; ours = the raw final state"),
        _case("adaptive-none-r2", {"num_steps": 2, "criterion": "none"}, {"num_steps": 2},
              "adaptive path that never exits = fixed depth 2"),
        _case("adaptive-none-continuous-r2", {"num_steps": 2, "criterion": "none", "continuous_compute": True},
              {"num_steps": 2, "warm_start": True}, "adaptive path warm start = the raw state at exit (as ours)"),
        _case("adaptive-none-r16", {"num_steps": ADAPTIVE_MAX, "criterion": "none"}, {"num_steps": ADAPTIVE_MAX},
              "adaptive path that never exits = fixed depth 16"),
        _case("adaptive-none-continuous-r16",
              {"num_steps": ADAPTIVE_MAX, "criterion": "none", "continuous_compute": True},
              {"num_steps": ADAPTIVE_MAX, "warm_start": True},
              "adaptive path warm start = the raw state at exit (as ours)"),
        _case("adaptive-kl-auto-continuous-r16",
              {"num_steps": ADAPTIVE_MAX, "criterion": "kl", "exit_threshold": "auto", "continuous_compute": True},
              {"num_steps": ADAPTIVE_MAX, "exit_criterion": "kl", "exit_threshold": AUTO["kl"], "warm_start": True},
              "official exits in prefill; ours runs the prompt at full depth"),
    ]
    for criterion, label, threshold, ours in _criterion_variants():
        note = ("we have no minp-kl criterion" if ours is None
                else "official: exit allowed in prefill, statistics from step 1; ours: prefill at full depth")
        out.append(_case(f"adaptive-{criterion}-{label}-r16",
                         {"num_steps": ADAPTIVE_MAX, "criterion": criterion, "exit_threshold": threshold},
                         ours, note))
    # Each criterion once more with the other two official defaults set to ours (latest-m4, no exit
    # in prefill), so the criterion's own semantics can be compared.
    ours_like = {"cache_lookup_strategy": "latest-m4", "do_not_exit_in_prefill": True}
    for criterion, label, threshold, ours in _criterion_variants():
        kwargs = {"num_steps": ADAPTIVE_MAX, "criterion": criterion, "exit_threshold": threshold, **ours_like}
        out.append(_case(f"adaptive-{criterion}-{label}-r16-latest-m4-no-exit-in-prefill", kwargs, ours,
                         "we have no minp-kl criterion" if ours is None else "criterion semantics alone"))
        if label == "auto" and ours is not None:
            out.append(_case(f"adaptive-{criterion}-auto-r16-min-steps-3-latest-m4-no-exit-in-prefill",
                             {**kwargs, "min_steps": 3}, {**ours, "min_steps": 4},
                             "official min_steps=3 skips check and statistic before step 4; ours "
                             "min_steps=4 updates the statistic from step 1"))
            out.append(_case(f"adaptive-{criterion}-auto-r16-continuous-latest-m4-no-exit-in-prefill",
                             {**kwargs, "continuous_compute": True}, {**ours, "warm_start": True},
                             "warm start from the raw state at exit (both)"))
    for criterion in ("kl", "latent-diff"):
        base = {"num_steps": ADAPTIVE_MAX, "criterion": criterion, "exit_threshold": "auto"}
        ours = {"num_steps": ADAPTIVE_MAX, "exit_criterion": criterion, "exit_threshold": AUTO[criterion]}
        out += [
            _case(f"adaptive-{criterion}-min-steps-3", {**base, "min_steps": 3}, {**ours, "min_steps": 4},
                  "official min_steps=3: no check or statistic update before step 4; ours min_steps=4 "
                  "(earliest exit at 4) still updates the statistic from step 1"),
            _case(f"adaptive-{criterion}-check-every-2", {**base, "check_criterion_every_n_steps": 2}, None,
                  "we have no check_criterion_every_n_steps"),
            _case(f"adaptive-{criterion}-min-steps-3-check-every-2",
                  {**base, "min_steps": 3, "check_criterion_every_n_steps": 2}, None,
                  "we have no check_criterion_every_n_steps"),
            _case(f"adaptive-{criterion}-no-exit-in-prefill", {**base, "do_not_exit_in_prefill": True}, ours,
                  "ours always runs the prompt at full depth"),
            _case(f"adaptive-{criterion}-exit-in-prefill", {**base, "do_not_exit_in_prefill": False}, None,
                  "we have no option to exit during the prompt"),
        ]
    for strategy in LOOKUPS:
        lookup, note = _ours_lookup(strategy)
        ours = None if lookup is None else {"num_steps": ADAPTIVE_MAX, "exit_criterion": "kl",
                                            "exit_threshold": AUTO["kl"], **lookup}
        for prefill in (False, True):
            suffix = "-no-exit-in-prefill" if prefill else ""
            out.append(_case(
                f"adaptive-kl-lookup-{strategy}{suffix}",
                {"num_steps": ADAPTIVE_MAX, "criterion": "kl", "exit_threshold": "auto",
                 "cache_lookup_strategy": strategy, "do_not_exit_in_prefill": prefill},
                ours, note + ("" if prefill else "; official exits in prefill, ours does not")))
    for draft, lookahead, threshold in ((4, 4, 1), (2, 3, 1), (4, 8, 1), (2, 4, 0.5)):
        kwargs = {"num_steps": FIXED_DEPTH, "draft_steps": draft, "lookahead_for_draft": lookahead,
                  "verification_threshold": threshold}
        ours = {"num_steps": FIXED_DEPTH, "draft_steps": draft, "lookahead": lookahead,
                "verification_threshold": float(threshold)}
        out.append(_case(f"speculative-draft{draft}-lookahead{lookahead}-v{threshold}", kwargs, ours,
                         "generate_speculative; the official result may run past max_new_tokens by a round"))
    for case in out:
        # The official loops (all but plain transformers generate) also stop at its hard-coded ids.
        custom_loop = any(k in case["kwargs"] for k in ("criterion", "continuous_compute", "draft_steps"))
        if custom_loop and case["ours_closest"] is not None:
            case["ours_closest"].setdefault("stop", list(OFFICIAL_STOPS))
    stops = {"eos_token_id": [65505, *stop_ids]}
    stop_note = ("official stops at 65504/65505/65508 and the generation config's eos (a list); "
                 "plain transformers generate only at the config's eos; ours at stop= and the config's eos")
    ours_stop = {"stop": [*OFFICIAL_STOPS, *stop_ids]}
    out += [
        _case("stop-hf-generate-eos-list", fixed, {**fixed, "stop": [65505, *stop_ids]}, stop_note, stops),
        _case("stop-generate-minimal-eos-list", {**fixed, "continuous_compute": False}, {**fixed, **ours_stop},
              stop_note, stops),
        _case("stop-generate-minimal-default-eos", {**fixed, "continuous_compute": False},
              {**fixed, "stop": list(OFFICIAL_STOPS)}, stop_note),
        _case("stop-hf-generate-default-eos", fixed, fixed, stop_note),
        # depth 3: the last prompt emits <|end_turn|> at its 9th token (see hf-generate-fixed-r3, which runs on)
        _case("stop-generate-minimal-end-turn-r3", {"num_steps": 3, "continuous_compute": False},
              {"num_steps": 3, "stop": list(OFFICIAL_STOPS)}, stop_note),
        _case("stop-adaptive-none-end-turn-r3", {"num_steps": 3, "criterion": "none"},
              {"num_steps": 3, "stop": list(OFFICIAL_STOPS)}, stop_note),
        _case("stop-adaptive-none-eos-list", {"num_steps": FIXED_DEPTH, "criterion": "none"},
              {**fixed, **ours_stop}, stop_note, stops),
        _case("stop-speculative-eos-list",
              {"num_steps": FIXED_DEPTH, "draft_steps": 4, "lookahead_for_draft": 4},
              {**fixed, "draft_steps": 4, "lookahead": 4, **ours_stop}, stop_note, stops),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# worker: runs in the scratch Python; imports torch, transformers and the official module only


def _import_official(checkout: Path) -> Any:
    """Import recpre/raven_modeling_minimal.py from `checkout` as a package of its own (its relative
    import needs a package; recpre/__init__.py itself would import the training code)."""
    import importlib
    import types

    package = types.ModuleType("huginn_official")
    package.__path__ = [str(checkout / "recpre")]
    sys.modules["huginn_official"] = package
    return importlib.import_module("huginn_official.raven_modeling_minimal")


def _count_steps(model: Any) -> list[list[int]]:
    """Wrap the instance's methods: segments [positions, core steps], one per forward / embed_inputs."""
    segments: list[list[int]] = []

    def starts_segment(method: Any) -> Any:
        @functools.wraps(method)  # transformers validates generate kwargs against forward's signature
        def wrapped(input_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
            segments.append([int(input_ids.shape[1]), 0])
            return method(input_ids, *args, **kwargs)
        return wrapped

    core = model.core_block_forward

    def counted_core(*args: Any, **kwargs: Any) -> Any:
        segments[-1][1] += 1
        return core(*args, **kwargs)

    model.forward = starts_segment(model.forward)
    model.embed_inputs = starts_segment(model.embed_inputs)
    model.core_block_forward = counted_core
    return segments


def worker(checkout: Path, model_dir: Path, cases_file: Path, out_file: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    torch.set_num_threads(1)
    official = _import_official(checkout)
    model = official.RavenForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    # The stored freqs_cis (save_official_layout writes it) must equal the table built in __init__.
    assert torch.equal(model.freqs_cis, model._precompute_freqs_cis())
    segments = _count_steps(model)
    spec = json.loads(cases_file.read_text())
    with torch.no_grad():
        logits = [model(torch.tensor([p]), num_steps=FIXED_DEPTH, init_scale=0.0).logits[0] for p in PROMPTS]
    torch.save(logits, out_file.with_suffix(".logits.pt"))
    results = []
    for case in spec["cases"]:
        runs = []
        for prompt in PROMPTS:
            segments.clear()
            ids = torch.tensor([prompt])
            config = GenerationConfig(**case["generation_config"])
            try:
                out = model.generate(ids, config, **case["kwargs"])
            except Exception as exc:  # recorded: an official error is part of its behaviour
                runs.append({"prompt": prompt, "error": f"{type(exc).__name__}: {exc}"})
                continue
            sequence = out if isinstance(out, torch.Tensor) else out.sequences
            run = {"prompt": prompt, "tokens": sequence[0, len(prompt):].tolist(),
                   "forward_segments": [s for s in segments if s[1] > 0]}
            if "criterion" in case["kwargs"]:
                run["steps"] = [s[1] for s in run["forward_segments"]][: len(run["tokens"])]
            runs.append(run)
        results.append({**case, "runs": runs})
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}
    out_file.write_text(json.dumps({"environment": meta, "cases": results}))


# ---------------------------------------------------------------------------------------------
# record / compare: run with our environment


def _our_imports() -> Any:
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import tests.official_golden_support as support

    return support


def record(checkout: Path, python: str, out: Path) -> None:
    import torch

    support = _our_imports()
    import recurrent_depth as rd

    torch.set_num_threads(1)
    model = support.build_golden_model()
    fixed = rd.generate(model, torch.tensor([PROMPTS[-1]]), max_new_tokens=NEW_TOKENS, num_steps=FIXED_DEPTH,
                        init_scale=0.0)
    new = fixed.sequences[0, len(PROMPTS[-1]):].tolist()
    # An extra eos that ends the last prompt's fixed-depth run early: its first new token from index 4 on.
    stop_ids = [next(t for i, t in enumerate(new) if i >= 4 and t not in new[:i])]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        support.write_official_dir(model, tmp_path / "model")
        (tmp_path / "cases.json").write_text(json.dumps({"cases": cases(stop_ids)}))
        subprocess.run([python, __file__, "worker", "--official", str(checkout), "--model-dir",
                        str(tmp_path / "model"), "--cases", str(tmp_path / "cases.json"),
                        "--out", str(tmp_path / "out.json")], check=True)
        recorded = json.loads((tmp_path / "out.json").read_text())
        official_logits = torch.load(tmp_path / "out.logits.pt", weights_only=True)
    with torch.no_grad():
        ours = [model(torch.tensor([p]), num_steps=FIXED_DEPTH, init_scale=0.0).logits[0] for p in PROMPTS]
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, official_logits, strict=True))
    golden = {
        "official": {"repository": "seal-rg/recurrent-pretraining", "revision": REVISION_FULL,
                     "file": "recpre/raven_modeling_minimal.py", **recorded["environment"]},
        "how": ("model.generate(torch.tensor([prompt]), GenerationConfig(**generation_config), **kwargs) on "
                "the official RavenForCausalLM loaded (fp32, dynamic cache) from the model below written as "
                "an official checkpoint; tokens = the new tokens; steps (adaptive path) = core steps per "
                "generated token, the first being the prompt's; forward_segments = [positions, core steps] "
                "per forward / embed_inputs call. ours_closest = the rd.generate options of recurrent-depth "
                "28aa291 nearest to the case (null: none), not a claim that they agree."),
        "model": {**support.MODEL_SPEC, "state_dict_sha256": support.state_dict_sha256(model)},
        "forward_check": {"num_steps": FIXED_DEPTH, "init_scale": 0.0, "prompts": PROMPTS,
                          "max_abs_logit_diff": diff},
        "prompts": PROMPTS,
        "stop_ids": stop_ids,
        "cases": recorded["cases"],
    }
    out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out}: {len(golden['cases'])} cases, forward max |diff| = {diff:.3g}")


def compare(golden_path: Path) -> None:
    import torch

    support = _our_imports()
    import recurrent_depth as rd

    torch.set_num_threads(1)
    golden = json.loads(golden_path.read_text())
    model = support.build_golden_model(golden["model"])
    for case in golden["cases"]:
        if case["ours_closest"] is None:
            print(f"{case['name']:50s} no-option")
            continue
        verdicts = []
        for run in case["runs"]:
            if "error" in run:
                verdicts.append("official-error")
                continue
            out = rd.generate(model, torch.tensor([run["prompt"]]), **case["ours_closest"])
            length = int(out.lengths[0])
            tokens = out.sequences[0, len(run["prompt"]):][:length].tolist()
            same = tokens == run["tokens"]
            steps_same = "steps" not in run or out.steps[0, :length].tolist() == run["steps"]
            if same:
                verdicts.append("agree" if steps_same else "tokens-agree")
            elif len(run["tokens"]) > length and run["tokens"][:length] == tokens:
                verdicts.append("prefix")  # the official loop ran past max_new_tokens
            else:
                first = next((i for i, (a, b) in enumerate(zip(tokens, run["tokens"])) if a != b),
                             min(len(tokens), len(run["tokens"])))
                verdicts.append(f"differ@{first}")
        print(f"{case['name']:50s} {' '.join(verdicts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["record", "compare", "worker"])
    parser.add_argument("--official", type=Path, help="an official checkout (holds recpre/)")
    parser.add_argument("--python", help="the scratch Python with torch + transformers 4.56 (record)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / f"official_{REVISION}.json")
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cases", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.official, args.model_dir, args.cases, args.out)
    elif args.mode == "record":
        if args.official is None or args.python is None:
            parser.error("record needs --official and --python")
        record(args.official, args.python, args.out)
    else:
        compare(args.out)


if __name__ == "__main__":
    main()
