"""`rdepth eval --lora` and `rdepth analyze --lora`: an adapter applied unmerged gives the merged model's numbers
(text scores, the --reasoning grid's model, --lm-eval-tasks, the analysis), checked as `rdepth generate --lora` is."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from tests.test_hf import make_model_dir

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny base (with tokenizer), an adapter of it with nonzero B, the merged model (`rdepth export`), and
    another model of the same shapes (for the base fingerprint check)."""
    from recurrent_depth.train.lora import LoraSpec, add_lora, save_adapter

    root = tmp_path_factory.mktemp("lora_eval")
    base, adapter, merged, other = (root / name for name in ("base", "adapter", "merged", "other"))
    make_model_dir(base)
    make_model_dir(other, seed=1)
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(base), LoraSpec(rank=2, alpha=4, dropout=0.1),
                       base_dir=base, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 after peft's init: the adapter then changed nothing
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    save_adapter(wrapped, adapter)
    assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "--out", str(merged)]) == 0
    return {"base": base, "adapter": adapter, "merged": merged, "other": other}


def numbers(tree: Any, path: str = "") -> dict[str, float]:
    """Every float leaf of a JSON tree, by its path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in numbers(sub, f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in numbers(sub, f"{path}/{i}").items()}
    return {path: tree} if isinstance(tree, float) else {}


def assert_same_numbers(got: Any, expected: Any) -> None:
    got, expected = numbers(got), numbers(expected)
    assert got.keys() == expected.keys() and got
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=TOL, abs_tol=TOL), (key, got[key], value)


def differs(a: Any, b: Any) -> bool:
    a, b = numbers(a), numbers(b)
    return any(not math.isclose(a[k], b[k], rel_tol=TOL, abs_tol=TOL) for k in a.keys() & b.keys())


def run_eval(out: Path, model_flags: list[str], extra: list[str], capsys) -> dict[str, Any]:
    assert main(["eval", *model_flags, "--out", str(out), "--depths", "1,3", "--init-scale", "0",
                 "--batch-size", "4", *extra]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return json.loads((out / "results.json").read_text())


def test_eval_text_and_reasoning_with_lora_equal_the_merged_model(dirs, tmp_path, capsys, monkeypatch):
    from recurrent_depth.evaluation.reasoning import evaluate

    probe = torch.arange(5, 17).unsqueeze(0)
    seen: list[torch.Tensor] = []
    grid = evaluate.accuracy_grid

    def recording_grid(model, *args, **kwargs):  # the logits of the model the reasoning grid runs on
        with torch.no_grad():
            seen.append(model(probe, num_steps=3, init_scale=0.0).logits)
        return grid(model, *args, **kwargs)

    monkeypatch.setattr(evaluate, "accuracy_grid", recording_grid)
    extra = ["--data", "stdlib", "--max-docs", "2", "--max-tokens", "300", "--reasoning", "chains",
             "--difficulties", "1", "--count", "2"]
    lora = run_eval(tmp_path / "lora", ["--model", str(dirs["base"]), "--lora", str(dirs["adapter"])], extra, capsys)
    merged = run_eval(tmp_path / "merged", ["--model", str(dirs["merged"])], extra, capsys)
    base = run_eval(tmp_path / "base", ["--model", str(dirs["base"])], extra, capsys)

    assert lora["config"]["lora"] == str(dirs["adapter"])
    assert_same_numbers(lora["text"], merged["text"])
    assert differs(lora["text"], base["text"])
    assert torch.allclose(seen[0], seen[1], atol=TOL) and not torch.allclose(seen[0], seen[2], atol=TOL)


def test_eval_lm_eval_tasks_with_lora_score_with_the_merged_models_numbers(dirs, tmp_path, capsys, monkeypatch):
    """The --lm-eval-tasks path builds its own backend model: the adapter goes onto it too. lm-eval's task index
    (over 10 s to build) is left out: the backend scores one request as lm-eval's loglikelihood requests do."""
    lm_eval = pytest.importorskip("lm_eval")
    from recurrent_depth.evaluation import depth_eval

    def scored(model, tasks, **kwargs):
        (logprob, _), = model._loglikelihood_tokens([(None, [5, 6, 7, 8, 9], [10, 11])], disable_tqdm=True)
        return {"results": {tasks[0]: {"logprob": logprob}}}

    monkeypatch.setattr(depth_eval, "_task_manager", lambda config: None)
    monkeypatch.setattr(lm_eval, "simple_evaluate", scored)
    extra = ["--data", "none", "--lm-eval-tasks", "rd_stdlib_bpb"]
    lora = run_eval(tmp_path / "lora", ["--model", str(dirs["base"]), "--lora", str(dirs["adapter"])], extra, capsys)
    merged = run_eval(tmp_path / "merged", ["--model", str(dirs["merged"])], extra, capsys)
    base = run_eval(tmp_path / "base", ["--model", str(dirs["base"])], extra, capsys)
    assert_same_numbers(lora["lm_eval"], merged["lm_eval"])
    assert differs(lora["lm_eval"], base["lm_eval"])
    # the adapter against its own base (--baseline naming --model's directory): the baseline scores without it
    # (the adapter went onto both when the two paths were equal)
    versus = run_eval(tmp_path / "versus", ["--model", str(dirs["base"]), "--lora", str(dirs["adapter"]),
                                            "--baseline", str(dirs["base"]), "--baseline-depth", "3"], extra, capsys)
    assert_same_numbers(versus["lm_eval"], merged["lm_eval"])
    assert_same_numbers(versus["baseline"]["lm_eval"], {k: v["3"] for k, v in base["lm_eval"]["0"].items()})


def test_analyze_with_lora_equals_the_merged_model(dirs, tmp_path, capsys):
    def analysis(name: str, model_flags: list[str]) -> dict[str, Any]:
        out = tmp_path / name
        assert main(["analyze", *model_flags, "--ids", "5,77,120,31", "--steps", "8", "--limit-steps", "16",
                     "--starts", "2", "--no-states", "--out", str(out)]) == 0, capsys.readouterr().err
        capsys.readouterr()
        result = json.loads((out / "analysis.json").read_text())
        result["model"].pop("name")  # (the directories differ)
        result.pop("timings_s")
        return result

    lora = analysis("lora", ["--model", str(dirs["base"]), "--lora", str(dirs["adapter"])])
    merged = analysis("merged", ["--model", str(dirs["merged"])])
    base = analysis("base", ["--model", str(dirs["base"])])
    assert_same_numbers(lora, merged)
    assert differs(lora, base)


@pytest.mark.parametrize("command", [["eval", "--data", "stdlib"], ["analyze", "--ids", "5,6"]],
                         ids=["eval", "analyze"])
def test_lora_flags_are_checked_as_generate_checks_them(dirs, tmp_path, capsys, command):
    def error(*flags: str) -> str:
        assert main([*command, *flags, "--out", str(tmp_path / "out")]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(lines) == 1, lines
        return lines[0]

    adapter = str(dirs["adapter"])
    dora = tmp_path / "dora"  # (a DoRA adapter cannot go on --weights layers: its forward reads the float weight)
    shutil.copytree(adapter, dora)
    (dora / "adapter_config.json").write_text(json.dumps({**json.loads(
        (dora / "adapter_config.json").read_text()), "use_dora": True}))
    assert "onto int8 weights: it is a DoRA adapter" in error("--model", str(dirs["base"]), "--lora", str(dora),
                                                              "--weights", "int8")
    assert "--strict-lora-base checks the base of a --lora adapter" in error("--model", str(dirs["base"]),
                                                                             "--strict-lora-base")
    assert not (tmp_path / "out").exists()  # (both refused before anything loads)
    assert error("--model", str(dirs["other"]), "--lora", adapter, "--strict-lora-base").endswith(
        "refused by the strict base check")
