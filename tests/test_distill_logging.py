"""A distilled run logs its loss's two parts; runs started together with one distill_cache do not tear it."""

import json
import threading

import pytest
import torch

from recurrent_depth.files import held_lock
from recurrent_depth.scaling.sweep import plan_sweep
from recurrent_depth.train.distill_cache import WRITE_LOCK, write_cache
from recurrent_depth.train.trainer import Trainer
from tests.test_distill import RowsOnly, random_teacher
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def test_metrics_hold_the_ce_and_kl_whose_mix_is_the_logged_loss(tmp_path):
    """Only the mixed loss reached metrics.jsonl: a user tuning --distill-alpha saw neither part."""
    import recurrent_depth as rd

    root = prepare_root(tmp_path / "root")
    teacher = tmp_path / "teacher"
    torch.manual_seed(11)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        teacher, tokenizer=root / "tokenizer")
    alpha, temperature = 0.3, 2.0
    cfg = tiny_train_config(root, tmp_path / "run", max_steps=2, grad_accum=2, eval_depths=[1], eval_batches=1,
                            teacher=str(teacher), teacher_depth=1, distill_alpha=alpha,
                            distill_temperature=temperature)
    Trainer(cfg).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        ce, kl = record["distill_ce"], record["distill_kl"]
        assert ce > 0 and kl > 0 and ce != pytest.approx(record["loss"], rel=1e-3)
        # the micro-steps' parts are averaged as the loss is, so they mix to it (distill.distillation_loss)
        assert (1 - alpha) * ce + alpha * temperature**2 * kl == pytest.approx(record["loss"], rel=1e-6)


def sweep(grid):
    base = {"preset": "tiny", "data": "stdlib", "seq_len": 32, "batch_size": 4, "max_steps": 3,
            "teacher": "/teachers/t", "distill_top_k": 4, "distill_cache": "/caches/c"}
    return {run.name: run.config["distill_cache"] for run in plan_sweep({"base": base, "grid": grid,
                                                                         "test_depths": [1]}).runs}


def test_sweep_runs_that_need_different_caches_get_their_own_directories():
    """A grid over seed (or top-k, seq_len, ...) sent every run to one cache directory: run after run wrote it
    again (or failed: `does not match this run`), with --jobs over each other's shards."""
    assert set(sweep({"mean_recurrence": [2, 4]}).values()) == {"/caches/c"}  # one cache serves them all
    caches = sweep({"seed": [0, 1], "mean_recurrence": [2, 4]})
    assert len(set(caches.values())) == 2 and all(c.startswith("/caches/c/cache-") for c in caches.values())
    assert caches["r2-s0"] == caches["r4-s0"] != caches["r2-s1"] == caches["r4-s1"]
    assert len(set(sweep({"distill_top_k": [4, 8]}).values())) == 2


def test_a_cache_being_written_is_waited_for_and_then_reused(tmp_path):
    """Two runs writing one cache at once shared its fixed temporary file names and tore the shards; the second
    now waits for the first's lock and reuses what it wrote."""
    calls = []

    def teacher(input_ids, first_row):
        calls.append(first_row)
        return random_teacher(input_ids, first_row)

    options = dict(top_k=4, vocab_size=VOCAB, data_key="k", teacher_info={"seed": 0}, batch_size=2,
                   log=lambda message: messages.append(message))
    messages: list[str] = []
    out = tmp_path / "cache"
    out.mkdir()
    with held_lock(out / WRITE_LOCK, 5.0):  # another run is writing
        writer = threading.Thread(target=write_cache, args=(teacher, RowsOnly(6), out), kwargs=options)
        writer.start()
        writer.join(0.3)
        assert writer.is_alive() and not calls  # it waits rather than writing beside the holder
    writer.join(10)
    assert not writer.is_alive() and len(calls) == 3
    write_cache(teacher, RowsOnly(6), out, **options)  # the same settings, finished meanwhile: not written again
    assert len(calls) == 3 and "written meanwhile" in messages[-1]
