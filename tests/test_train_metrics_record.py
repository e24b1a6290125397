"""What a run reports, checked against plain recomputations: tensorboard against metrics.jsonl, validation
against the saved weights, the SFT collapse monitor without padding, the report's tables and the run record."""

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.analysis.correlation import token_correlation_reference
from recurrent_depth.data.chat import Example
from recurrent_depth.inference.sampling import stream_generator
from recurrent_depth.train import report
from recurrent_depth.train.run_record import git_revision, tensorboard_step
from recurrent_depth.train.sft import pack_examples
from recurrent_depth.train.validation import batch_losses
from tests.train_support import OneThread, prepare_root, tiny_train_config


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


class Scalars:
    """A stand-in `SummaryWriter` that keeps what `add_scalar` got."""

    def __init__(self) -> None:
        self.values: dict[str, dict[int, float]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.values.setdefault(tag, {})[step] = value


def test_tensorboard_gets_every_number_of_the_record():
    """Only a fixed list went to tensorboard: `rdepth rl`'s reward_mean, SFT's scored_tokens, indexer_kl, ...
    were in metrics.jsonl only."""
    tb = Scalars()
    record = {"step": 3, "loss": 2.5, "num_steps": [3, 5], "grad_steps": [2, 2], "grad_norm": None, "skipped": False,
              "skip_reason": None, "tokens": 512, "reward_mean": 0.25, "scored_tokens": 40, "indexer_kl": 0.125}
    tensorboard_step(tb, record)
    assert tb.values == {"train/loss": {3: 2.5}, "train/tokens": {3: 512}, "train/reward_mean": {3: 0.25},
                         "train/scored_tokens": {3: 40}, "train/indexer_kl": {3: 0.125}, "train/depth": {3: 4.0}}


def test_run_scalars_validation_and_record_match_plain_recomputations(tmp_path_factory):
    """A tiny run end to end: its tensorboard scalars are its metrics.jsonl numbers, its final validation loss
    is the saved weights' plain loss at each depth from each row's documented s_0 stream, and run.json names
    that stream's seed."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recurrent_depth.data import ShardDataset
    from recurrent_depth.train.trainer import Trainer

    root = prepare_root(tmp_path_factory.mktemp("metrics_root"))
    out = root / "run"
    cfg = tiny_train_config(root, out, max_steps=2, eval_batches=1, batch_size=2, eval_depths=[1, 3],
                            tensorboard=True, seed=3)
    Trainer(cfg).run()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()][-1]
    run = json.loads((out / "run.json").read_text())
    assert run["seeds"]["validation_state"] == 3

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens", "step_s"):
        assert scalars[f"train/{key}"] == {m["step"]: pytest.approx(m[key], rel=1e-6) for m in metrics}
    assert scalars["val_loss/depth_3"] == {2: pytest.approx(final["val_loss_by_depth"]["3"], rel=1e-6)}

    model = rd.RecurrentDepthLM.from_pretrained(str(out / "model")).eval()
    rows = torch.as_tensor(ShardDataset(root / "data" / "validation.json", shuffle=False).rows(range(2))).long()
    for depth in (1, 3):
        total = 0.0
        for r in range(rows.shape[0]):
            like = torch.empty(1, rows.shape[1] - 1, model.config.hidden_size)
            s0 = model.initial_state(like, model.config.init_scale, stream_generator(3, r, torch.device("cpu")))
            with torch.no_grad():
                logits = model(rows[r:r + 1, :-1], num_steps=depth, input_states=s0).logits
            total += float(F.cross_entropy(logits[0], rows[r, 1:], reduction="sum"))
        assert final["val_loss_by_depth"][str(depth)] == pytest.approx(total / rows[:, 1:].numel(), rel=1e-5)
    assert final["val_tokens"] == rows[:, 1:].numel()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "one-per-row"])
def test_sft_collapse_monitor_leaves_the_padding_out(packing):
    """SFT's validation correlated the padded tail's states too: a fresh model's 0.00 read as ~0.5 (collapse)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=300)).eval()
    g = torch.Generator().manual_seed(0)
    lengths = (10, 8, 12, 2)  # the last fills one position: alone in its row it has no pair
    examples = [Example(ids=torch.randint(1, 300, (n,), generator=g).tolist(), scored=[False] + [True] * (n - 1))
                for n in lengths]
    batch = pack_examples(examples, 40, 0, packing).batch(torch.arange(1 if packing else len(lengths)))
    _, corr = batch_losses(model, batch, [4], generator_seed=0)
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    with torch.no_grad():
        state = model(**inputs, num_steps=4, generator=torch.Generator().manual_seed(0)).final_state
    if packing:
        real = [(0, slice(0, sum(n - 1 for n in lengths)))]
    else:
        real = [(r, slice(0, n - 1)) for r, n in enumerate(lengths) if n - 1 >= 2]
    want = [float(token_correlation_reference(state[r, cols])) for r, cols in real]
    rows = batch["input_ids"].shape[0]
    assert float(corr[4]) == pytest.approx(sum(want) / len(want) * rows, abs=1e-5)


def test_loss_curve_survives_a_diverged_validation_depth(tmp_path):
    """eval.jsonl writes a diverged depth's loss as null: the report's loss curve raised a TypeError."""
    metrics = [{"step": s, "loss": 5.0 - s / 10, "num_steps": [3]} for s in range(1, 6)]
    evals = [{"step": 3, "val_loss_by_depth": {"1": None, "2": None}},
             {"step": 5, "val_loss_by_depth": {"1": None, "2": 4.0}}]
    assert report.plot_loss_curve(metrics, tmp_path / "loss.png", evals).stat().st_size > 0


def test_report_tables_name_the_depth_they_compare_against(tmp_path):
    """The deltas are against the smallest depth evaluated; the header said 'vs depth 1' whatever it was."""
    paths = report.write_training_report(tmp_path, {"val_loss_by_depth": {"2": 4.0, "8": 3.5}}, {}, None)
    markdown, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "| depth | validation loss | vs depth 2 |" in markdown and "| 8 | 3.5000 | -0.5000 |" in markdown
    assert "<th>vs depth 2</th>" in page and "vs depth 1" not in markdown + page and len(paths) == 2


def test_git_revision_is_the_package_checkouts_only(tmp_path):
    """A package installed inside another project's checkout (an ignored venv) recorded that project's commit
    as its own; a tracked file still gets its checkout's commit."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args: str) -> str:
        import os

        done = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True,
                              env={**os.environ, **env})
        return done.stdout.strip()

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not available")
    (tmp_path / ".gitignore").write_text("venv/\n")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    (tmp_path / "venv" / "pkg").mkdir(parents=True)
    (tmp_path / "venv" / "pkg" / "run_record.py").write_text("x = 1\n")
    git("add", ".gitignore", "tracked.py")
    git("commit", "-q", "-m", "project")
    assert git_revision(tmp_path / "venv" / "pkg" / "run_record.py") == {"commit": None, "dirty": None}
    assert git_revision(tmp_path / "tracked.py") == {"commit": git("rev-parse", "HEAD"), "dirty": False}
