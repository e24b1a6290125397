"""Post-training under torchrun (2 CPU ranks, gloo) against one process with the same global batch:
`rdepth sft --lora` (and its resume), `rdepth train --init-from` an Ouro-style model with gradient accumulation,
and a bad data line. One launch runs every command (start-up dominates the time); this file is also its worker:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_torchrun_post_training.py ROOT OUT
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # (the worker: run as a script by torchrun)
    sys.path[:0] = [str(REPO), str(REPO / "src")]

from tests.train_support import VOCAB, OneThread, prepare_root  # noqa: E402

# Depth fixed and s0 the embedding (no random draw): two ranks compute one process's numbers.
COMMON = ["--seq-len", "32", "--eval-depths", "1,2", "--eval-batches", "3", "--no-tensorboard", "--no-progress",
          "--threads", "1", "--depth-scheme", "fixed", "--mean-recurrence", "2", "--optimizer", "adamw", "--lr", "1e-2"]


def sft_argv(root: Path, out: Path, batch: int, steps: int, data: str = "chats.jsonl") -> list[str]:
    return ["sft", "--init-from", str(root / "model"), "--data", str(root / data), "--batch-size", str(batch),
            "--max-steps", str(steps), "--save-every", "2", "--lora", "--lora-rank", "2", *COMMON, "--out", str(out)]


def train_argv(root: Path, out: Path, batch: int) -> list[str]:
    return ["train", "--init-from", str(root / "ouro"), "--data", str(root / "corpus"), "--data-dir",
            str(root / "data"), "--batch-size", str(batch), "--grad-accum", "2", "--max-steps", "3", *COMMON,
            "--eval-interval", "2", "--out", str(out)]


def worker(root: Path, out: Path) -> None:
    """Each command on this rank, in one process group the commands leave as they found it."""
    import torch.distributed as dist

    from recurrent_depth.cli import main

    dist.init_process_group("gloo")
    report = {}
    runs = {"lora": sft_argv(root, out / "lora", batch=2, steps=2),
            "lora-resumed": [*sft_argv(root, out / "lora", batch=2, steps=4), "--resume"],
            "ouro": train_argv(root, out / "ouro", batch=2),
            "bad-line": sft_argv(root, out / "bad", batch=2, steps=2, data="bad.jsonl")}
    for name, argv in runs.items():
        dist.barrier()  # (rank 0 has written the previous command's files)
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        report[name] = [code, stdout.getvalue(), stderr.getvalue()]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Tokenizer, corpus, chats (and one with a bad line), a tiny model and a tiny Ouro-style one (exit gate)."""
    import recurrent_depth as rd
    from recurrent_depth.data.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
    from tests.test_sft import write_chats

    root = prepare_root(tmp_path_factory.mktemp("torchrun_post"))
    specials = special_token_ids(load_tokenizer(root / "tokenizer"))
    ids = dict(vocab_size=VOCAB, max_seq_len=64, bos_token_id=specials["begin_text"],
               eos_token_id=eos_token_ids(specials), pad_token_id=specials["pad"])
    torch.manual_seed(3)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", state_init="embedding", **ids)).save_pretrained(
        root / "model", tokenizer=root / "tokenizer")
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", **ids)).save_pretrained(
        root / "ouro", tokenizer=root / "tokenizer")
    lines = write_chats(root / "chats.jsonl", count=40).read_text().splitlines()
    (root / "bad.jsonl").write_text("\n".join([*lines[:30], '{"messages": [', *lines[30:]]) + "\n")
    return root


@pytest.fixture(scope="module")
def launched(root, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("torchrun_out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(root), str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_same_run(two: Path, one: Path) -> None:
    """Two ranks' run directory holds one process's records and weights, up to float rounding."""
    from safetensors.torch import load_file

    for name in ("metrics.jsonl", "eval.jsonl"):
        records, alone = lines(two / name), lines(one / name)
        if name == "eval.jsonl":  # (a run stopped and resumed adds the final evaluation where it stopped)
            records = records[-len(alone):]
        assert len(records) == len(alone) > 0, name  # (rank 0 alone wrote: no record twice)
        for mine, wanted in zip(records, alone, strict=True):
            assert mine["step"] == wanted["step"]
            for key in {"loss", "grad_norm", "num_steps", "scored_tokens", "tokens", "val_loss_by_depth"} & set(wanted):
                assert mine[key] == pytest.approx(wanted[key], rel=1e-5), (name, key)
    weights = "adapter_model.safetensors" if (one / "model" / "adapter_model.safetensors").is_file() else \
        "model.safetensors"
    mine, wanted = load_file(two / "model" / weights), load_file(one / "model" / weights)
    assert mine.keys() == wanted.keys()
    for key in wanted:
        torch.testing.assert_close(mine[key], wanted[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_lora_sft_on_two_ranks_and_its_resume_equal_one_process(root, launched, tmp_path, capsys):
    from recurrent_depth.cli import main

    out, ranks = launched
    assert [rank["lora"][0] for rank in ranks] == [rank["lora-resumed"][0] for rank in ranks] == [0, 0]
    assert ranks[1]["lora"][1] == ranks[1]["lora-resumed"][1] == ""  # rank 0 alone prints
    assert main(sft_argv(root, tmp_path / "one", batch=4, steps=4)) == 0
    # 2 steps, then resumed on 2 ranks for 2 more: one process's 4 steps (adapter gradients all-reduced)
    assert_same_run(out / "lora", tmp_path / "one")
    # a resume on another number of processes is refused in one line
    capsys.readouterr()
    assert main([*sft_argv(root, out / "lora", batch=2, steps=6), "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rdepth sft: error: cannot resume from {out / 'lora' / 'checkpoints' / 'step-00000004'}: it was written by "
        "2 process(es), this run has 1")


@pytest.mark.slow
def test_continued_pretraining_of_an_exit_gate_model_on_two_ranks_equals_one_process(root, launched, tmp_path):
    """DDP waited for gradients of the Ouro-style exit gate, which the loss never reaches: the second step on 2 ranks
    failed ("Expected to have finished reduction in the prior iteration"). DDP now looks for unused parameters
    where a model has them."""
    from recurrent_depth.cli import main

    out, ranks = launched
    assert [rank["ouro"][0] for rank in ranks] == [0, 0], ranks[0]["ouro"][2][-2000:]
    assert main(train_argv(root, tmp_path / "one", batch=4)) == 0
    assert_same_run(out / "ouro", tmp_path / "one")


@pytest.mark.slow
def test_a_bad_data_line_stops_every_rank_with_one_line(launched):
    _, ranks = launched
    for code, _, stderr in (rank["bad-line"] for rank in ranks):
        assert code == 2
        assert stderr.strip().splitlines()[-1].startswith("rdepth sft: error: ") and "bad.jsonl:31: " in stderr


def test_ddp_looks_for_unused_parameters_only_where_a_model_has_them():
    import recurrent_depth as rd
    from recurrent_depth.train.distributed import loss_may_skip_parameters
    from recurrent_depth.train.lora import LoraSpec, add_lora

    def model(preset: str = "tiny", **overrides) -> rd.RecurrentDepthLM:
        return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(preset, vocab_size=64, **overrides))

    assert not loss_may_skip_parameters(model())
    assert loss_may_skip_parameters(model("tiny-ouro"))  # the exit gate; the embedding reached through s0 alone
    assert loss_may_skip_parameters(model("tiny-ouro", exit_gate=False))
    assert loss_may_skip_parameters(model(mixer="dsa"))  # the indexer, trained by its own loss only
    assert not loss_may_skip_parameters(model(mixer="dsa", mixer_options={"indexer_loss": True}))
    assert not loss_may_skip_parameters(add_lora(model("tiny-ouro"), LoraSpec(rank=2)))  # (the base is frozen)


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(Path(sys.argv[1]), Path(sys.argv[2]))
