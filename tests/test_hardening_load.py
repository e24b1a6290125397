"""Issue 19, loading and new-user items: hostile model directories, data files and flags get a one-line
error fast (no hang, no huge allocation, no path out of the tree), and the rough edges a new user
hits are gone. Each test reproduces one reported case, bounded in time and memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.config import MAX_NUM_STEPS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
         "for i in range(10):\n    print(i)\n"]


def bpe_tokenizer(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"], show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    return tok


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320)).eval()


@pytest.fixture
def model_dir(tmp_path, model) -> Path:
    path = tmp_path / "model"
    model.save_pretrained(path, tokenizer=bpe_tokenizer())
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def one_line_error(err: str) -> str:
    """The one `rdepth CMD: error: ...` line of stderr (other lines are notices, such as the thread choice)."""
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- item 3 (and 13): one depth ceiling
def test_train_mean_recurrence_1e6_fails_fast_naming_the_ceiling(tmp_path, capsys):
    code, err = run_cli(["train", "--preset", "tiny", "--mean-recurrence", "1e6", "--max-steps", "1",
                         "--out", str(tmp_path / "run")], capsys)
    line = one_line_error(err)
    assert code == 2 and "mean_recurrence=1000000.0" in line and f"at most {MAX_NUM_STEPS}" in line
    assert "--max-depth" in line
    assert not (tmp_path / "run").exists()  # refused before any work
    # The ceiling is a flag: raised, the same config is accepted (not run here).
    from recurrent_depth.train.config import TrainConfig

    assert TrainConfig(mean_recurrence=2000.0, max_depth=4096).mean_recurrence == 2000.0
    with pytest.raises(ValueError, match="eval_depths"):
        TrainConfig(eval_depths=[1, MAX_NUM_STEPS + 1])


def test_config_bounds_mean_recurrence_when_loaded(tmp_path, model):
    model.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    values["mean_recurrence"] = 1_000_000_000
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"ModelConfig\.mean_recurrence=1000000000 is invalid: expected at most 1024"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


def test_generate_depth_flags_are_capped_by_max_depth(model_dir, capsys):
    code, err = run_cli(["generate", "--model", str(model_dir), "--prompt", "def", "--num-steps", "4000000000"],
                        capsys)
    line = one_line_error(err)
    assert code == 2 and "--num-steps=4000000000" in line and "--max-depth" in line
    code, err = run_cli(["generate", "--model", str(model_dir), "--prompt", "def", "--max-new-tokens", "1",
                         "--num-steps", "3", "--max-depth", "2"], capsys)
    assert code == 2 and "[0, 2]" in err
    code, _ = run_cli(["generate", "--model", str(model_dir), "--prompt", "def", "--max-new-tokens", "1",
                       "--num-steps", "3", "--max-depth", "3", "--no-stream"], capsys)
    assert code == 0


def test_eval_and_analyze_depths_are_capped_by_max_depth(model_dir, tmp_path, capsys):
    """`rdepth eval --depths 5000` and `rdepth analyze --steps 2000` ran past the one depth ceiling."""
    base = ["--model", str(model_dir), "--out", str(tmp_path / "out")]
    cases = [(["eval", *base, "--data", "none", "--reasoning", "chains", "--depths", "1,5000"], "--depths=5000"),
             (["eval", *base, "--data", "none", "--reasoning", "chains", "--baseline-depth", "2000"],
              "--baseline-depth=2000"),
             (["analyze", *base, "--ids", "1,2", "--steps", "2000"], "--steps=2000"),
             (["analyze", *base, "--ids", "1,2", "--steps", "4", "--limit-steps", "9", "--max-depth", "8"],
              "--limit-steps=9 is invalid: expected an integer in [0, 8]")]
    for argv, message in cases:
        code, err = run_cli(argv, capsys)
        assert code == 2 and message in one_line_error(err) and "--max-depth" in err
    assert not (tmp_path / "out").exists()  # refused before any work
    code, err = run_cli(["analyze", *base, "--ids", "1,2", "--max-depth", "0"], capsys)
    assert code == 2 and "--max-depth=0 is invalid" in one_line_error(err)



def test_eval_baseline_default_depth_keeps_max_depth(model_dir, tmp_path, capsys):
    """`rdepth eval --baseline DIR --max-depth 2` scored the baseline at its mean_recurrence 4 (past the ceiling)."""
    argv = ["eval", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--data", "none", "--reasoning",
            "chains", "--count", "1", "--difficulties", "0", "--depths", "1", "--baseline", str(model_dir),
            "--max-depth", "2"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "mean_recurrence=4" in one_line_error(err) and "--baseline-depth" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_serve_max_num_steps_default_is_capped_by_the_ceiling(model, tmp_path):
    from recurrent_depth.serving import build_app, default_max_num_steps

    assert default_max_num_steps(4) == 64
    assert default_max_num_steps(1000) == MAX_NUM_STEPS  # not 4000: the config cannot lift the ceiling
    assert default_max_num_steps(1000, max_depth=8192) == 4000
    with pytest.raises(ValueError, match=r"max_num_steps=4000000000 is invalid: .*--max-depth"):
        build_app(model, tokenizer_dir=None, max_num_steps=4_000_000_000)
    assert "--max-depth" in subprocess_help("serve")


def test_serve_default_depth_is_within_max_num_steps(model):
    """`rdepth serve --max-num-steps 2` (or `--max-depth 2`) on a model of mean_recurrence 4 started, and
    served requests without num_steps at depth 4 while refusing an explicit num_steps of 4."""
    from recurrent_depth.serving import build_app

    mean = model.config.mean_recurrence
    for limit in ({"max_num_steps": mean - 1}, {"max_depth": mean - 1}):
        with pytest.raises(ValueError, match=rf"mean_recurrence={mean} .* above max_num_steps={mean - 1}.*--num-steps"):
            build_app(model, tokenizer_dir=None, **limit)
    build_app(model, tokenizer_dir=None, max_num_steps=mean - 1, num_steps=mean - 1)  # a default within the cap
    build_app(model, tokenizer_dir=None, max_num_steps=mean)


def subprocess_help(command: str) -> str:
    from recurrent_depth.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub.format_help()


# ---------------------------------------------------------------- item 7: bounded reads, header first, lazy RoPE
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_config_json_as_a_device_is_refused_without_reading(tmp_path, device):
    (tmp_path / "config.json").symlink_to(device)
    with pytest.raises(ValueError, match="not a regular file"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


def test_config_json_as_a_fifo_does_not_block(tmp_path, capsys):
    os.mkfifo(tmp_path / "config.json")  # no writer: a plain open() would wait forever
    code, err = run_cli(["info", "--model", str(tmp_path)], capsys)
    assert code == 2 and "not a regular file" in one_line_error(err)


def test_oversized_config_is_refused_by_size(tmp_path):
    with open(tmp_path / "config.json", "wb") as handle:
        handle.truncate(64 * 2**20)  # sparse: no disk, no memory
    with pytest.raises(ValueError, match=r"67,108,864 bytes, more than the 16,777,216 allowed"):
        rd.ModelConfig.from_json(tmp_path)


def test_config_is_checked_against_the_weight_header_before_building(tmp_path, model):
    model.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    values["core_layers"] = 1000  # within MAX_LAYERS: only the header can tell
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="core_layers=1000 but the weights hold 2 core_block layers"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


def test_rope_table_is_built_for_the_length_in_use(model, monkeypatch):
    from recurrent_depth.model import layers

    long = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320, max_seq_len=50_000_000)).eval()
    long.load_state_dict(model.state_dict())
    built: list[int] = []
    original = layers.rope_table
    monkeypatch.setattr(layers, "rope_table", lambda dim, n, *a, **k: built.append(n) or original(dim, n, *a, **k))
    ids = torch.tensor([[5, 7]])
    torch.testing.assert_close(long(ids, num_steps=3, init_scale=0.0).logits,
                               model(ids, num_steps=3, init_scale=0.0).logits, rtol=0, atol=0)
    short = rd.generate(model, ids, max_new_tokens=3, num_steps=2, init_scale=0.0)
    out = rd.generate(long, ids, max_new_tokens=3, num_steps=2, init_scale=0.0)
    assert torch.equal(out.sequences, short.sequences)
    assert built and max(built) <= layers.ROPE_EAGER_POSITIONS  # not 50,000,000 rows (8 GB)
    assert layers.rope_table_length(10**9, needed=5000) == 8192


# ---------------------------------------------------------------- item 8: nothing outside the tree
def test_weight_map_may_not_leave_the_directory(tmp_path, model):
    model.save_pretrained(tmp_path / "model", max_shard_bytes=200_000)
    index_path = tmp_path / "model" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.move(tmp_path / "model" / first, tmp_path / first)
    for outside in (f"../{first}", str(tmp_path / first)):
        index["weight_map"] = {k: (outside if v == first else v) for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))
        with pytest.raises(ValueError, match="lies outside"):
            rd.RecurrentDepthLM.from_pretrained(tmp_path / "model")
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path / "model", allow_outside=True)  # the explicit opt-in
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)
    # A hub-cache snapshot: the index names files inside, which are symlinks into a blob store next door.
    index["weight_map"] = {k: (first if v.endswith(first) else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    (tmp_path / "model" / first).symlink_to(tmp_path / first)
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path / "model")
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)


def test_shard_index_may_not_name_files_outside(tmp_path):
    import numpy as np

    from recurrent_depth.data.shards import ShardDataset, ShardWriter, read_index, write_index

    (tmp_path / "data").mkdir()
    with ShardWriter(tmp_path / "data", "train", row_len=4, dtype=np.uint16) as writer:
        writer.write_rows([np.arange(4), np.arange(4, 8)])
    shards = writer.shards
    index = {"format": "recurrent-depth-token-shards", "version": 1, "split": "train", "dtype": "uint16",
             "seq_len": 3, "row_len": 4, "num_rows": 2, "shards": shards}
    secret = tmp_path / "secret.bin"
    shutil.copyfile(tmp_path / "data" / shards[0]["file"], secret)
    write_index(tmp_path / "data" / "train.json", {**index, "shards": [{**shards[0], "file": str(secret)}]})
    with pytest.raises(ValueError, match="lies outside"):
        ShardDataset(tmp_path / "data" / "train.json")
    write_index(tmp_path / "data" / "train.json", {**index, "shards": {"file": "x"}})  # item 9: not a list
    with pytest.raises(ValueError, match="'shards' must be a list"):
        read_index(tmp_path / "data" / "train.json")


def test_corpus_symlinks_out_of_the_directory_need_a_flag(tmp_path, capsys):
    from recurrent_depth.data import load_corpus

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("inside\n")
    (tmp_path / "private.txt").write_text("not yours\n")
    (tmp_path / "corpus" / "b.txt").symlink_to(tmp_path / "private.txt")
    with pytest.raises(ValueError, match=r"'b.txt' .* is a symlink to .*private.txt, outside .*--follow-symlinks"):
        list(load_corpus(tmp_path / "corpus"))
    docs = list(load_corpus(tmp_path / "corpus", follow_symlinks=True))
    assert [d.text for d in docs] == ["inside\n", "not yours\n"]
    code, err = run_cli(["train", "--data", str(tmp_path / "corpus"), "--max-steps", "1",
                         "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "--follow-symlinks" in one_line_error(err)


# ---------------------------------------------------------------- item 9: one-line errors, not tracebacks
@pytest.mark.parametrize("command", ["generate", "analyze"])
def test_corrupt_tokenizer_json_is_one_line(model_dir, command, capsys):
    (model_dir / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    argv = [command, "--model", str(model_dir), "--prompt", "def"]
    if command == "analyze":
        argv += ["--out", str(model_dir.parent / "analysis"), "--steps", "8", "--limit-steps", "8", "--starts", "2"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "is not a valid tokenizers file" in one_line_error(err)


def test_deeply_nested_json_is_one_line(tmp_path, model):
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        rd.ModelConfig.from_json(deep)
    model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    (tmp_path / "model.safetensors.index.json").write_text(deep)
    with pytest.raises(ValueError, match="nested too deeply"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("values", [
    {"intermediate_size": 2**62},
    {"hidden_size": 100_000_000, "num_heads": 4},
], ids=["intermediate-2^62", "hidden-1e8"])
def test_size_overflows_are_refused_before_allocating(tmp_path, model, values):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **values}))
    with pytest.raises(ValueError, match="more than MAX_PARAMETERS"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


def test_huginn_n_embd_1e9_and_model_set_overflow(capsys, tmp_path):
    huginn = {"model_type": "huginn_raven", "n_embd": 10**9, "n_heads": 50, "n_layers_in_prelude": 2,
              "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "padded_vocab_size": 65536,
              "intermediate_size": 17920, "block_size": 4096, "mean_recurrence": 32, "mean_backprop_depth": 8}
    with pytest.raises(ValueError, match="more than MAX_PARAMETERS"):
        rd.ModelConfig.from_dict(huginn)
    code, err = run_cli(["train", "--model-set", "hidden_size=100000000", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "more than MAX_PARAMETERS" in one_line_error(err)


def test_damaged_optimizer_and_trainer_state_files_are_one_line(tmp_path):
    from recurrent_depth.train import checkpointing as ckpt

    state = {"state": {0: {"exp_avg": torch.ones(64, 64), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3}]}
    ckpt.save_state_files(tmp_path, "optimizer", state)
    assert torch.equal(ckpt.load_state_files(tmp_path, "optimizer")["state"][0]["exp_avg"], torch.ones(64, 64))
    tensors = tmp_path / "optimizer.safetensors"
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is truncated"):
        ckpt.load_state_files(tmp_path, "optimizer")
    tensors.write_bytes(data)
    meta = (tmp_path / "optimizer.json").read_text()
    (tmp_path / "optimizer.json").write_text(meta.replace('"state.0.exp_avg"', '"state.0.renamed"'))
    with pytest.raises(ValueError, match="names tensor 'state.0.renamed' that .* does not hold"):
        ckpt.load_state_files(tmp_path, "optimizer")
    (tmp_path / ckpt.TRAINER_STATE).write_text(json.dumps({"step": 3, "tokens": 10}))
    with pytest.raises(ValueError, match=r"lacks the fields \['micro_step', 'skipped_steps', 'elapsed_s', 'data'\]"):
        ckpt.read_trainer_state(tmp_path)


# ---------------------------------------------------------------- item 14: a saved directory is complete
def test_save_pretrained_with_tokenizer_serves_every_model_option(tmp_path, model, capsys):
    from transformers import AutoTokenizer

    model.save_pretrained(tmp_path / "m", tokenizer=bpe_tokenizer())
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "m")).encode("def add", add_special_tokens=False)
    code, _ = run_cli(["generate", "--model", str(tmp_path / "m"), "--prompt", "def", "--max-new-tokens", "2",
                       "--num-steps", "2", "--no-stream"], capsys)
    assert code == 0


def test_tokenizer_flag_for_a_directory_without_one(tmp_path, model, capsys):
    model.save_pretrained(tmp_path / "bare")
    bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    code, err = run_cli(["generate", "--model", str(tmp_path / "bare"), "--prompt", "def"], capsys)
    assert code == 2 and "pass --tokenizer DIR" in one_line_error(err)
    code, _ = run_cli(["generate", "--model", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                       "--prompt", "def", "--max-new-tokens", "2", "--num-steps", "2", "--no-stream"], capsys)
    assert code == 0
    (tmp_path / "tok").mkdir()
    bpe_tokenizer().save(str(tmp_path / "tok" / "tokenizer.json"))
    code, _ = run_cli(["export", "--model", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "tok"),
                       "--out", str(tmp_path / "exported"), "--dtype", "float32"], capsys)
    assert code == 0 and (tmp_path / "exported" / "tokenizer.json").is_file()
    for command in ("generate", "analyze", "serve", "eval", "export"):
        assert "--tokenizer" in subprocess_help(command)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_weight_files_follow_the_umask(tmp_path, model, umask):
    old = os.umask(umask)
    try:
        model.save_pretrained(tmp_path / "m")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "m" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


# ---------------------------------------------------------------- item 15: the README's test command
def test_readme_test_command_prints_the_summary_line():
    command = "python -m pytest -q"
    assert command in (ROOT / "README.md").read_text() and (ROOT / ".ci" / "run").read_text().rstrip().endswith(
        command)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_config.py", "-k", "presets"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- item 16: rough edges
def test_baseline_with_another_tokenizer_scores_the_same_bytes(tmp_path, model, capsys):
    from recurrent_depth.evaluation.depth_eval import EvalConfig, evaluate_depths

    (tmp_path / "docs").mkdir()
    for i in range(40):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(TEXTS[i % 3] * (i % 5 + 2))
    model.save_pretrained(tmp_path / "a", tokenizer=bpe_tokenizer(300))
    torch.manual_seed(1)
    other = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320))
    other.save_pretrained(tmp_path / "b", tokenizer=bpe_tokenizer(270))  # fewer merges: more tokens per byte
    for d in ("a", "b"):  # scoring needs a bos token
        config = json.loads((tmp_path / d / "tokenizer_config.json").read_text())
        config["bos_token"] = "<|end|>"
        (tmp_path / d / "tokenizer_config.json").write_text(json.dumps(config))
    results = evaluate_depths(EvalConfig(model=str(tmp_path / "a"), depths=[1, 2], out=str(tmp_path / "out"),
                                         data=str(tmp_path / "docs"), val_fraction=0.5, max_tokens=120,
                                         baseline=str(tmp_path / "b"), baseline_depth=1), log=print)
    text, base = results["text"], results["baseline"]["text"]
    assert text["tokens"] == 120 and base["bytes"] == text["bytes"] and base["tokens"] != text["tokens"]
    assert f"the same {text['bytes']:,} bytes" in capsys.readouterr().out


def test_unknown_lm_eval_task_and_quiet_git_probe(tmp_path, monkeypatch, capfd):
    from lm_eval.tasks import TaskManager

    from recurrent_depth.evaluation.lm_eval_env import check_task_names, quiet_git_probe
    from recurrent_depth.evaluation.tasks import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    check_task_names(manager, ["rd_chains_mc"])
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['nosuchtask'\]; this library ships"):
        check_task_names(manager, ["rd_chains_mc", "nosuchtask"])
    import lm_eval.evaluator

    quiet_git_probe()
    monkeypatch.chdir(tmp_path)  # not a git repository
    capfd.readouterr()
    lm_eval.evaluator.get_git_commit_hash()
    assert "fatal" not in capfd.readouterr().err


def test_analyze_errors_name_flags(capsys, tmp_path):
    code, err = run_cli(["analyze", "--model", str(tmp_path), "--ids", "1,2", "--steps", "8", "--limit-steps", "4"],
                        capsys)
    line = one_line_error(err)
    assert code == 2 and "--limit-steps=4" in line and "limit_steps" not in line and "--steps" in line


def test_version(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"rdepth {rd.__version__}"
    # issue 33 item 7: `rdepth --version` imports neither torch nor transformers (it took 5 s)
    probe = "import sys; from recurrent_depth.cli import main; main(['--version']); " \
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"rdepth {rd.__version__}", "[]"]


def test_quickstart_task_never_says_up_to_none():
    from recurrent_depth.cli.quickstart import extrapolation_line

    line = extrapolation_line("modsum", {"trained_up_to": 12, "beyond_training_at_0.9": None,
                                         "beyond_training_at_0.5": None})
    assert "None" not in line and "at no difficulty beyond training" in line


def test_accuracy_grid_shows_progress_with_an_eta(capsys, monkeypatch):
    from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
    from recurrent_depth.evaluation.reasoning.evaluate import accuracy_grid
    from recurrent_depth.evaluation.reasoning.tasks import get_task

    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320)).eval()
    accuracy_grid(model, get_task("modsum"), [2], [1], count=4, encoder=ProblemEncoder(), progress=True)
    assert "evaluating modsum" not in capsys.readouterr().err  # issue 33 item 7: no bar into a pipe or a log
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # on a terminal
    accuracy_grid(model, get_task("modsum"), [2], [1], count=4, encoder=ProblemEncoder(), progress=True)
    err = capsys.readouterr().err
    assert "evaluating modsum" in err and "4/4" in err and "<" in err  # tqdm's elapsed<remaining


def test_info_prints_human_readable_sizes(capsys):
    assert main(["info", "--preset", "huginn-0125"]) == 0
    out = capsys.readouterr().out
    assert "3.56 B (3,564,976,800" in out and "GiB" in out and "MiB" in out


def test_serve_startup_errors_name_the_flags(model_dir, capsys):
    """`rdepth serve --max-batch 0` said "max_batch=0 is invalid", the keyword of the Python function."""
    from recurrent_depth.cli.serve import flag_spelled

    flags = {"max_batch": 0, "num_steps": 2000, "max_num_steps": None, "kv_quant": "k=prod:3,seed=1"}
    assert flag_spelled("num_steps=2000 is invalid: expected an integer in [0, max_num_steps=64]", flags) == (
        "--num-steps 2000 is invalid: expected an integer in [0, --max-num-steps 64]")
    assert flag_spelled("kv_quant='k=prod:3,seed=1' is invalid", flags) == "--kv-quant 'k=prod:3,seed=1' is invalid"
    code, err = run_cli(["serve", "--model", str(model_dir), "--port", "18659", "--max-batch", "0"], capsys)
    assert code == 2
    assert one_line_error(err) == "rdepth serve: error: --max-batch 0 is invalid: expected an integer in [1, 16777216]"
    # (and the upper bounds: --max-batch 10**23 sized tensors past int64, --tokenizer-workers started that many
    # processes at once)
    for flag, value, bound in (("--max-batch", "100000000000000000000000", "16777216"), ("--tokenizer-workers",
                                                                                       "100000", "256")):
        code, err = run_cli(["serve", "--model", str(model_dir), "--port", "18659", flag, value], capsys)
        assert code == 2 and one_line_error(err) == (
            f"rdepth serve: error: {flag} {value} is invalid: expected an integer in [1, {bound}]")
