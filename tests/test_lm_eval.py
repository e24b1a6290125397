"""lm-evaluation-harness: the recurrent-depth backend, lm-eval's own hf backend, the `rdepth lm-eval` wrapper."""

from __future__ import annotations

import functools
import json
import math

import lm_eval
import pytest
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import recurrent_depth.integrations  # noqa: F401  (what `import recurrent_depth` installs)
from recurrent_depth.cli import main
from recurrent_depth.cli.lm_eval import prepare_argv
from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
from recurrent_depth.evaluation.tasks import TASKS_DIR
from tests.test_hf import make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval-model")
    make_model_dir(path, max_seq_len=160)
    return path


@pytest.fixture(scope="module")
def tasks():
    # Only our rd_* tasks: indexing lm-eval's own ~15k task configs takes 10+ s and no test here needs them.
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture
def shipped_tasks_only(monkeypatch):
    """lm-eval's CLI and `rdepth eval` build a TaskManager per run, indexing lm-eval's own ~15k task configs
    (10+ s): here they index only the include_path (our rd_* tasks). test_rdepth_lm_eval_runs_lm_evals_cli
    keeps the full index, so one run checks our tasks beside lm-eval's."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))


def evaluate(lm, tasks, names, limit=4, **kwargs):
    return lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=tasks, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **kwargs)


def test_backend_is_registered_by_name():
    assert get_model("recurrent-depth") is RecurrentDepthEvalLM
    assert get_model("hf") is not None  # registering ours keeps lm-eval's own table


def test_offline_tasks_run_through_the_backend_and_record_steps(model_dir, tasks, tmp_path):
    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=3, init_scale=0.0, device="cpu", batch_size=4,
                              steps_log=str(tmp_path / "steps.json"))
    out = evaluate(lm, tasks, ["rd_chains_mc", "rd_chains_gen", "rd_addition_gen"])
    assert set(out["results"]) == {"rd_chains_mc", "rd_chains_gen", "rd_addition_gen"}
    assert 0 <= out["results"]["rd_chains_mc"]["acc,none"] <= 1
    info = out["config"]["recurrent_depth"]
    assert info["num_steps"] == 3 and info["steps"]["loglikelihood"]["histogram"] == {"3": 40}
    assert info["steps"]["generate_until"]["mean_steps"] == 3.0
    assert json.loads((tmp_path / "steps.json").read_text())["steps"] == info["steps"]


def test_exit_criterion_and_kv_budget_reach_scoring(model_dir, tasks):
    fixed = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=6, init_scale=0.0, device="cpu", batch_size=8)
    adaptive = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=6, init_scale=0.0, device="cpu",
                                    batch_size=8, exit_criterion="latent-diff", exit_threshold=10.0, min_steps=2)
    zero = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=6, init_scale=0.0, device="cpu",
                                batch_size=8, exit_criterion="kl", exit_threshold=0.0, kv_budget=6)
    results = {name: evaluate(lm, tasks, ["rd_chains_mc"], limit=3)["results"]["rd_chains_mc"]["acc,none"]
               for name, lm in (("fixed", fixed), ("adaptive", adaptive), ("zero", zero))}
    assert results["zero"] == results["fixed"]  # threshold 0 with budget = depth is fixed depth exactly
    assert adaptive.steps_summary()["loglikelihood"]["histogram"] == {"2": 30}  # exits as soon as allowed
    assert zero.steps_summary()["loglikelihood"]["mean_steps"] == 6


def test_hf_backend_with_mean_recurrence_matches_the_backend(model_dir, tasks):
    """lm-eval's own `hf` backend evaluates at the depth given by `mean_recurrence=N` in model_args."""
    ours = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=2, init_scale=0.0, device="cpu")
    theirs = lm_eval.api.registry.get_model("hf").create_from_arg_string(
        f"pretrained={model_dir},mean_recurrence=2,init_scale=0.0,dtype=float32", {"device": "cpu", "batch_size": 1}
    )
    assert theirs.model.config.mean_recurrence == 2
    a = evaluate(ours, tasks, ["rd_stdlib_bpb"], limit=1)["results"]["rd_stdlib_bpb"]["bits_per_byte,none"]
    b = evaluate(theirs, tasks, ["rd_stdlib_bpb"], limit=1)["results"]["rd_stdlib_bpb"]["bits_per_byte,none"]
    assert math.isclose(a, b, rel_tol=1e-4)
    deeper = lm_eval.api.registry.get_model("hf").create_from_arg_string(
        f"pretrained={model_dir},mean_recurrence=5,init_scale=0.0,dtype=float32", {"device": "cpu", "batch_size": 1}
    )
    c = evaluate(deeper, tasks, ["rd_stdlib_bpb"], limit=1)["results"]["rd_stdlib_bpb"]["bits_per_byte,none"]
    assert not math.isclose(a, c, rel_tol=1e-4)


@pytest.mark.parametrize(
    "args, message",
    [({"num_steps": -1}, "num_steps=-1"), ({"exit_criterion": "bogus"}, "bogus"), ({"kv_budget": 0}, "kv_budget=0"),
     ({"warm_start": "maybe"}, "warm_start='maybe'"), ({"init_scale": -1.0}, "init_scale=-1.0"),
     ({"exit_threshold": 0.1}, "without an exit_criterion")],
    ids=["depth", "criterion", "budget", "warm-start", "init-scale", "threshold-alone"],
)
def test_bad_model_args_are_named(model_dir, args, message):
    with pytest.raises(ValueError, match=message):
        RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", **args)


def test_wrapper_adds_the_shipped_tasks_and_a_cpu_device():
    assert prepare_argv(["run", "--tasks", "x"], cuda_available=False) == [
        "run", "--tasks", "x", "--include_path", str(TASKS_DIR), "--device", "cpu"]
    assert prepare_argv(["--model", "hf", "--include_path", "mine", "--device", "cuda"], cuda_available=False) == [
        "--model", "hf", "--include_path", f"mine:{TASKS_DIR}", "--device", "cuda"]
    assert prepare_argv(["ls", "tasks"], cuda_available=False) == ["ls", "tasks", "--include_path", str(TASKS_DIR)]
    assert prepare_argv(["--help"], cuda_available=False) == ["--help"]


def test_rdepth_lm_eval_runs_lm_evals_cli(model_dir, tmp_path):
    argv = ["lm-eval", "run", "--model", "recurrent-depth", "--model_args",
            f"pretrained={model_dir},num_steps=2,init_scale=0", "--tasks", "rd_chains_mc", "--limit", "2",
            "--output_path", str(tmp_path / "results")]
    assert main(argv) == 0
    written = list((tmp_path / "results").rglob("results_*.json"))
    assert len(written) == 1
    results = json.loads(written[0].read_text())
    assert "rd_chains_mc" in results["results"]
    assert results["config"]["recurrent_depth"]["num_steps"] == 2


def test_init_scale_none_means_the_configs_and_rdepth_eval_runs_lm_eval_tasks(model_dir, tmp_path,
                                                                               shipped_tasks_only):
    # `rdepth eval --lm-eval-tasks ...` without --init-scale (the documented command) passed init_scale=None,
    # which the backend refused: "init_scale=None is invalid: expected a number in [0, inf)".
    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", num_steps=2, init_scale=None)
    assert lm.init_scale is None and lm.settings()["init_scale"] == lm._core.config.init_scale
    argv = ["eval", "--model", str(model_dir), "--data", "none", "--lm-eval-tasks", "rd_chains_mc",
            "--limit", "2", "--depths", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert 0 <= results["lm_eval"]["0"]["rd_chains_mc/acc"]["1"] <= 1


def test_rdepth_lm_eval_reports_bad_model_args_in_one_line(model_dir, capsys, shipped_tasks_only):
    # lm-eval types "-1" as -1.0, so the error read "num_steps=-1.0 ... expected None or an integer",
    # and it came as a traceback: `rdepth lm-eval` is outside main()'s one-line error handler.
    from recurrent_depth.inference.schema import from_text

    assert from_text("num_steps", -1.0) == -1 and from_text("init_scale", 2.0) == 2.0
    with pytest.raises(ValueError, match="num_steps=2.5 is invalid"):
        from_text("num_steps", 2.5)
    argv = ["lm-eval", "run", "--model", "recurrent-depth", "--model_args", f"pretrained={model_dir},num_steps=-1",
            "--tasks", "rd_chains_mc", "--limit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "rdepth lm-eval: error: num_steps=-1 is invalid: expected an integer >= 0"
    assert "Traceback" not in err
    argv[5] = f"pretrained={model_dir / 'missing'}"  # was transformers' "Repo id must use alphanumeric chars"
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rdepth lm-eval: error: pretrained={model_dir / 'missing'}: no such directory (expected a saved model "
        "directory)")
    argv[5] = f"pretrained={model_dir},bogus=1"  # was a TypeError traceback from the model's __init__
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rdepth lm-eval: error: model_args: bogus=1 is not an argument of lm-eval's HF model "
                           "or of ours (") and "num_steps" in last



def test_a_missing_relative_pretrained_is_one_line_naming_it(monkeypatch, tmp_path):
    """pretrained=runs/nope (a relative path that is not there) is tried as a hub id; offline, transformers'
    two-line message came out as the error, not naming the missing directory."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError) as info:
        RecurrentDepthEvalLM(pretrained="runs/nope")
    message = str(info.value)
    assert message.startswith("pretrained=runs/nope: no such directory, and as a hub id: ") and "\n" not in message

def test_rdepth_lm_eval_takes_threads(monkeypatch, capsys):
    # README: every command takes --threads N; `rdepth lm-eval` handed it to lm-eval, which refused it
    # ("unrecognized arguments: --threads 1") wherever it stood.
    import sys

    import lm_eval.__main__
    import torch

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append((sys.argv[1:], torch.get_num_threads())))
    before = torch.get_num_threads()
    try:
        assert main(["lm-eval", "run", "--threads", "2", "--tasks", "x", "--device", "cpu"]) == 0
        assert main(["lm-eval", "--threads=1", "ls", "tasks"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen[0] == (["run", "--tasks", "x", "--device", "cpu", "--include_path", str(TASKS_DIR)], 2)
    assert seen[1] == (["ls", "tasks", "--include_path", str(TASKS_DIR)], 1)
    assert main(["lm-eval", "--threads", "0", "run"]) == 2
    assert capsys.readouterr().err.strip() == ("rdepth lm-eval: error: argument --threads: expected an integer "
                                               ">= 1, got '0'")


def test_a_generation_seed_is_drawn_on_the_generators_device(model_dir, monkeypatch):
    """The backend's generator lives on its device (`cuda` on a GPU); `torch.randint` without `device=` draws
    on the CPU, which a CUDA generator refuses ("Expected a 'cpu' device type for generator")."""
    import torch

    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=2, init_scale=0.0, device="cpu", batch_size=1)
    draws, randint = [], torch.randint

    def spy(*args, **kwargs):
        if kwargs.get("generator") is lm._generator:
            draws.append(kwargs.get("device"))
        return randint(*args, **kwargs)

    monkeypatch.setattr(torch, "randint", spy)
    lm._model_generate(torch.tensor([[1, 2, 3]]), max_length=5, stop=[])
    assert draws == [lm._generator.device]


def test_loglikelihood_under_official_exit_defaults_is_a_teacher_forced_generate(model_dir):
    """defaults="official" with a criterion sets exit_in_prefill: generate stops the prompt's positions together
    at the criterion's step, but loglikelihood ran the context at full depth and scored other numbers."""
    import torch.nn.functional as F

    from recurrent_depth.inference import generate

    options = dict(defaults="official", exit_criterion="kl", exit_threshold=0.1)
    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=6, init_scale=0.0, device="cpu", batch_size=2,
                              **options)
    requests = [([1, 2, 3, 4, 5], [6, 7, 8, 9]), ([9, 4], [10, 11])]
    scored = lm._loglikelihood_tokens([(None, c, x) for c, x in requests])
    for (context, continuation), (logprob, _) in zip(requests, scored):
        out = generate(lm._core, [context], max_new_tokens=len(continuation), num_steps=6, init_scale=0.0,
                       teacher_tokens=[continuation], output_logits=True, **options)
        expected = sum(float(F.log_softmax(out.logits[0, j].float(), -1)[t]) for j, t in enumerate(continuation))
        assert math.isclose(logprob, expected, rel_tol=1e-4, abs_tol=1e-4)
    assert lm.steps_summary()["loglikelihood"]["tokens"] == 6


@pytest.mark.parametrize("args", [{}, {"exit_criterion": "kl", "exit_threshold": 1e-2}], ids=["fixed", "adaptive"])
def test_a_requests_score_does_not_depend_on_the_batch(model_dir, args):
    """With a random s_0 (the config's init_scale) the batch drew its s_0 from one stream: a request's score
    changed with batch_size and with the requests scored before it."""
    requests = [(None, [1, 2, 3, 4, 5], [6, 7, 8]), (None, [9], [10, 11]), (None, [3, 3, 3], [4])]
    scores = []
    for batch_size, order in ((1, [0, 1, 2]), (3, [0, 1, 2]), (2, [2, 1, 0])):
        lm = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=2, device="cpu", batch_size=batch_size,
                                  seed=5, **args)
        out = lm._loglikelihood_tokens([requests[i] for i in order])
        scores.append([out[order.index(i)] for i in range(3)])
    assert scores[0] == scores[1] == scores[2]
    other = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=2, device="cpu", seed=6, **args)
    assert other._loglikelihood_tokens(requests) != scores[0]  # the seed still draws s_0


def test_generate_until_does_not_depend_on_the_batch_size(model_dir):
    """One seed was drawn per batch (row b seeded seed + b): with a random s_0 a request's greedy text changed
    with batch_size."""
    from lm_eval.api.instance import Instance

    prompts = ["a=1;b=a;?b=", "def f(x):\n", "a=1;", "x"]
    requests = [Instance("generate_until", None, (p, {"until": ["\n\n"], "max_gen_toks": 4}), i)
                for i, p in enumerate(prompts)]
    texts = [RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=2, device="cpu", batch_size=size)
             .generate_until(requests, disable_tqdm=True) for size in (1, 4)]
    assert texts[0] == texts[1]
