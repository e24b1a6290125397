"""Follow-ups of the torchrun hunt (tests/test_dist_hunt.py): each test is the regression of one bug, the first three
on 2 CPU ranks (gloo, file store; the worker is tests/gloo_worker.py), in one launch."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.distributed as dist

from tests.test_gloo_ranks import run_ranks


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One launch of the modes (process start-up dominates the time); quickstart-lost ends it."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed gloo")
    return run_ranks(tmp_path_factory.mktemp("hunt2"), "resume-ranks+quickstart-lost")


@pytest.mark.usefixtures("one_thread")
def test_a_rank_that_dies_while_the_quickstart_prepares_ends_the_others_with_one_line(out):
    """`rdepth quickstart --task` under torchrun whose rank 0 died (killed) while it prepared `--out`: the other
    ranks, waiting in `run_on_main`'s broadcast, ended with gloo's 30-line traceback. Now with one line, exit 2."""
    code, said = torch.load(out / "quickstart-lost-rank1.pt", weights_only=True)
    assert code == 2
    assert said.startswith("rdepth quickstart: error: rank 1 stopped: another rank of this run failed")
    assert said.count("\n") == 1 and "Traceback" not in said


@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_that_fails_to_load_on_one_rank_is_set_aside_on_every_rank(out):
    """A resume shared only rank 0's load problem: rank 1, failing to read its own rng-rank1.safetensors of the
    newest checkpoint (an I/O error on its node), was told all was well and crashed (AttributeError on None) while
    rank 0 resumed from it. Now every rank's problem is gathered: all fall back to the same older checkpoint, and
    rank 0's line names the rank whose load failed."""
    ranks = [torch.load(out / f"resume-ranks-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [found["resumed"] for found in ranks] == [("step-00000001", 1)] * 2
    skipped, resumed = ranks[0]["logged"]
    assert "step-00000002: on rank 1: [Errno 5] Input/output error" in skipped
    assert skipped.endswith("moved it to step-00000002.invalid-1, resuming from step-00000001")
    assert resumed.endswith("step-00000001 at step 1")
    assert (out / "resume" / "checkpoints" / "step-00000002.invalid-1").is_dir()


@pytest.mark.usefixtures("one_thread")
def test_metrics_record_every_rank_s_depths_with_depth_per_rank(out):
    """With `--depth-per-rank` metrics.jsonl's num_steps held rank 0's depths alone (the depths the other ranks ran
    were nowhere). Now `num_steps_by_rank` and `grad_steps_by_rank` list every rank's, by rank."""
    ranks = [torch.load(out / f"resume-ranks-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    records = [json.loads(line) for line in ranks[0]["metrics"].splitlines()]
    assert len(records) == 2
    assert [r["num_steps_by_rank"] for r in records] == [list(d) for d in zip(ranks[0]["drawn"], ranks[1]["drawn"])]
    assert ranks[0]["drawn"] != ranks[1]["drawn"]  # (per-rank draws: the ranks ran other depths)
    assert [r["num_steps"] for r in records] == ranks[0]["drawn"]  # (num_steps stays rank 0's)
    assert all(len(r["grad_steps_by_rank"]) == 2 and r["grad_steps_by_rank"][0] == r["grad_steps"] for r in records)


def test_adapter_config_lists_target_modules_sorted(tmp_path):
    """adapter_config.json's target_modules came out in another order in each process (peft keeps a set, whose
    order follows the string hash seed, and writes it as it iterates): the same run's adapter differed byte for
    byte. Now `save_adapter` writes it sorted. (A stand-in for the peft model writes the set's order reversed, as
    another process's hash seed may; the real one costs seconds of imports.)"""
    from recurrent_depth.train.lora import ADAPTER_CONFIG, save_adapter

    targets = ["Wqkv", "fc", "proj"]

    def save_pretrained(directory: str, **_: object) -> None:  # (peft's: `list(value)` of each set field)
        config = {"target_modules": targets[::-1], "exclude_modules": ["b", "a"], "r": 2, "task_type": "CAUSAL_LM"}
        (tmp_path / "adapter" / ADAPTER_CONFIG).parent.mkdir()
        (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(config))

    saved = json.loads((save_adapter(types.SimpleNamespace(save_pretrained=save_pretrained), tmp_path / "adapter")
                        / ADAPTER_CONFIG).read_text())
    assert (saved["target_modules"], saved["exclude_modules"]) == (targets, ["a", "b"])
