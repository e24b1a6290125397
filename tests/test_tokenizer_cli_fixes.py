"""`rdepth tokenizer train`: --threads bounds the tokenizers library's own threads, an --out holding a tokenizer is
refused without --overwrite, and the summary says how many documents were trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_depth.cli import main as cli_main
from recurrent_depth.data.corpus import DocumentSplit, load_corpus


def _corpus(tmp_path: Path, count: int = 8) -> Path:
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(count):
        (data / f"d{i}.py").write_text(f"def handler_{i}(path):\n    return path + '{i}'\n" * 20)
    return data


# Counts this process's threads before and after a training: the tokenizers library starts its Rayon pool (and
# keeps it) on its first parallel work, so the difference is the pool's size.
_COUNT_POOL = """
import os, sys
from recurrent_depth.cli import main
import recurrent_depth.data.tokenizer
before = len(os.listdir("/proc/self/task"))
assert main(sys.argv[1:]) == 0
print("pool", len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_threads_bounds_the_tokenizer_training_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--threads N` set torch's threads only; the BPE trainer ran on a Rayon pool of one thread per core."""
    wanted = (os.cpu_count() or 1) + 1  # never the default pool size
    # (TOKENIZERS_PARALLELISM=false, which a server started earlier in this process sets for its workers, runs
    # the trainer without any pool)
    env = {k: v for k, v in os.environ.items() if k not in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_POOL, "tokenizer", "train", "--data", str(_corpus(tmp_path)),
         "--vocab-size", "300", "--out", str(tmp_path / "tok"), "--threads", str(wanted)],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    assert f"pool {wanted}\n" in result.stdout, result.stdout + result.stderr
    with pytest.raises(SystemExit):
        cli_main(["tokenizer", "train", "--help"])
    assert "RAYON_NUM_THREADS" in capsys.readouterr().out  # --help says what --threads bounds


def test_out_holding_a_tokenizer_is_refused_without_overwrite(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory given as --out had its tokenizer files silently replaced."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text('{"theirs": true}')
    args = ["tokenizer", "train", "--data", str(_corpus(tmp_path)), "--vocab-size", "300", "--out", str(model)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "already holds a tokenizer" in err and "--overwrite" in err
    assert (model / "tokenizer.json").read_text() == '{"theirs": true}'
    assert not (model / "tokenizer_training.json").exists()
    assert cli_main([*args, "--overwrite"]) == 0
    assert "theirs" not in (model / "tokenizer.json").read_text()


def test_summary_counts_the_documents_trained_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --val-fraction the line gave the whole corpus's document count as what it trained on."""
    data, out = _corpus(tmp_path), tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--val-fraction", "0.5",
                     "--seed", "1", "--out", str(out)]) == 0
    ids = list(load_corpus(str(data)).ids())
    split = DocumentSplit.plan(ids, 0.5, 1)
    trained = sum(not split.is_validation(i) for i in ids)
    assert 0 < trained < len(ids)
    assert f" on {trained} of the {len(ids)} documents of " in capsys.readouterr().out
    assert json.loads((out / "tokenizer_training.json").read_text())["trained_documents"] == trained


def test_tokenizer_train_runs_without_importing_torch(tmp_path: Path) -> None:
    """Its only torch import was data/shards.py's, at the package's import: seconds of start-up for a command that
    trains a BPE (and cli/__init__ imported torch to set --threads)."""
    code = ("import sys\nfrom recurrent_depth.cli import main\nassert main(sys.argv[1:]) == 0\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    result = subprocess.run(
        [sys.executable, "-c", code, "tokenizer", "train", "--data", str(_corpus(tmp_path)), "--vocab-size", "300",
         "--out", str(tmp_path / "tok"), "--threads", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "torch imported: False" in result.stdout, result.stdout + result.stderr
