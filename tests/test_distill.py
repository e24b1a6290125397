"""Distillation in the trainer: the loss formula, alpha = 0 is plain training, the teacher's own RNG, the cache."""

import json
import math

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.train.distill import Distillation, distillation_loss, load_teacher, teacher_generator
from recurrent_depth.train.distill_cache import bytes_per_token
from recurrent_depth.train.objective import LanguageModeling
from recurrent_depth.train.trainer import Trainer
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("distill_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


@pytest.fixture(scope="module")
def teacher_dir(train_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher") / "teacher"
    torch.manual_seed(11)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        path, tokenizer=train_root / "tokenizer")
    return path


def written_out_loss(student, teacher, targets, alpha, temperature, top_k=0):
    """(1 - alpha) CE + alpha T^2 mean_t KL, each term a Python sum over the vocabulary."""
    ce_terms, kl_terms = [], []
    for b in range(student.shape[0]):
        for t in range(student.shape[1]):
            if targets[b, t] == -100:
                continue
            zs, zt = student[b, t].tolist(), teacher[b, t].tolist()
            log_norm = math.log(sum(math.exp(z) for z in zs))
            ce_terms.append(log_norm - zs[int(targets[b, t])])
            soft_norm = math.log(sum(math.exp(z / temperature) for z in zs))
            kept = sorted(range(len(zt)), key=lambda i: -zt[i])[:top_k] if top_k else range(len(zt))
            teacher_norm = sum(math.exp(zt[i] / temperature) for i in kept)
            kl = 0.0
            for i in kept:
                q = math.exp(zt[i] / temperature) / teacher_norm
                kl += q * (math.log(q) - (zs[i] / temperature - soft_norm))
            kl_terms.append(kl)
    ce, kl = sum(ce_terms) / len(ce_terms), sum(kl_terms) / len(kl_terms)
    return (1 - alpha) * ce + alpha * temperature**2 * kl


@pytest.mark.parametrize("top_k", [0, 3])
def test_the_loss_equals_its_formula_written_out(top_k):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    teacher = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64) * 2
    targets = torch.tensor([[1, 4, -100], [0, 6, 2]])
    if top_k:
        values, indices = teacher.topk(top_k, dim=-1)
        total, _, _ = distillation_loss(student, targets, teacher_top=(values, indices), alpha=0.3, temperature=2.0)
    else:
        total, _, _ = distillation_loss(student, targets, teacher, alpha=0.3, temperature=2.0)
    expected = written_out_loss(student, teacher, targets, 0.3, 2.0, top_k)
    assert float(total) == pytest.approx(expected, rel=1e-5)


def weights(result):
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def test_alpha_zero_is_plain_training_bit_for_bit(train_root, teacher_dir, tmp_path):
    quick = dict(max_steps=3, eval_depths=[1], eval_batches=1)
    plain = Trainer(tiny_train_config(train_root, tmp_path / "plain", **quick)).run()
    zero = Trainer(tiny_train_config(train_root, tmp_path / "zero", teacher=str(teacher_dir), distill_alpha=0.0,
                                     **quick)).run()
    assert zero.losses == plain.losses
    a, b = weights(plain), weights(zero)
    assert all(torch.equal(a[k], b[k]) for k in a)


def recorded_draws(trainer):
    """Wrap the objective to record each micro-batch's depth, student generator state and global RNG state."""
    draws, inner = [], trainer.objective.loss

    def loss(model, batch, num_steps, generator):
        draws.append((num_steps, generator.get_state().clone(), torch.get_rng_state().clone()))
        out = inner(model, batch, num_steps, generator)
        draws.append(("after", torch.get_rng_state().clone()))
        return out

    trainer.objective.loss = loss
    return draws


def test_the_teacher_draws_from_its_own_generator(train_root, teacher_dir, tmp_path):
    quick = dict(max_steps=2, eval_depths=[1], eval_batches=1)
    plain = Trainer(tiny_train_config(train_root, tmp_path / "plain", **quick))
    taught = Trainer(tiny_train_config(train_root, tmp_path / "taught", teacher=str(teacher_dir), teacher_depth=8,
                                       distill_alpha=0.5, **quick))
    assert isinstance(taught.objective, Distillation) and isinstance(plain.objective, LanguageModeling)
    draws_plain, draws_taught = recorded_draws(plain), recorded_draws(taught)
    plain.run()
    result = taught.run()
    assert len(draws_plain) == len(draws_taught) == 4
    for a, b in zip(draws_plain, draws_taught, strict=True):
        assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:], strict=True))
    assert all(math.isfinite(x) for x in result.losses)


def test_a_written_cache_gives_the_on_the_fly_top_k_loss(train_root, teacher_dir, tmp_path):
    options = dict(max_steps=1, teacher=str(teacher_dir), teacher_depth=1, distill_top_k=8, distill_alpha=0.5)
    cached = Trainer(tiny_train_config(train_root, tmp_path / "run", distill_cache=str(tmp_path / "cache"), **options))
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["bytes_per_token"] == bytes_per_token(8, VOCAB) == 8 * (2 + 2)  # fp16 + int16
    # the teacher's initial states are drawn per write batch from the run seed: both fix the cached rows
    assert manifest["write_batch_size"] == cached.cfg.batch_size and manifest["teacher"]["seed"] == cached.cfg.seed
    rows = cached.data.dataset("train", shuffle=False).rows(list(range(4)))  # the cache's first teacher batch
    batch = {"input_ids": torch.from_numpy(rows[:, :-1]), "targets": torch.from_numpy(rows[:, 1:])}
    fly = Distillation(load_teacher(teacher_dir, 1), alpha=0.5, temperature=1.0, top_k=8, seed=0, position=lambda: 0)

    def loss(objective):
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            return float(objective.loss(cached.model, batch, (2, 1), generator)[0])

    assert loss(cached.objective) == pytest.approx(loss(fly), abs=2e-3)  # fp16-rounded teacher values
    manifest["num_rows"] += 1
    (tmp_path / "cache" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="distill_cache .* does not match this run: its num_rows"):
        Trainer(tiny_train_config(train_root, tmp_path / "run2", distill_cache=str(tmp_path / "cache"), **options))


def test_the_teacher_reads_packed_sft_rows_with_their_positions_and_document_mask(teacher_dir):
    """SFT packs examples into a row with position_ids and document_ids: the teacher must see them as the student
    does, not attend across examples."""
    teacher = load_teacher(teacher_dir, 2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    packed = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * 2),
              "document_ids": torch.tensor([[0] * 5 + [1] * 7] * 2)}
    batch = {"input_ids": ids, "targets": ids.roll(-1, 1), **packed}
    objective = Distillation(teacher, alpha=1.0, temperature=1.0, top_k=0, seed=0, position=lambda: 3)
    with torch.no_grad():
        student = rd.RecurrentDepthLM(teacher.model.config)
        objective.loss(student, batch, 2, torch.Generator().manual_seed(1))
        logits = student(ids, num_steps=2, generator=torch.Generator().manual_seed(1), **packed).logits
        expected = teacher.model(ids, num_steps=2, generator=teacher_generator(0, 3, "cpu"), **packed).logits
    _, _, kl = distillation_loss(logits, batch["targets"], expected, alpha=1.0, temperature=1.0)
    assert objective.last_kl == pytest.approx(float(kl), rel=1e-6)


def test_a_missing_teacher_or_another_vocabulary_is_a_one_line_error(train_root, tmp_path):
    with pytest.raises(ValueError, match="teacher=.* is not a directory"):
        Trainer(tiny_train_config(train_root, tmp_path / "a", teacher=str(tmp_path / "nowhere")))
    adapter = tmp_path / "lora-run" / "model"  # an `rdepth train --lora` run: an adapter, not a model
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no model/config.json: .*; it is a LoRA adapter .*--merge-lora"):
        load_teacher(adapter.parent)
    other = tmp_path / "other"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=512, max_seq_len=64)).save_pretrained(other)
    with pytest.raises(ValueError, match="has vocab_size 512, the student 384: distillation needs the same"):
        Trainer(tiny_train_config(train_root, tmp_path / "b", teacher=str(other)))
    short = tmp_path / "short"  # its context is shorter than the run's rows (seq_len 32)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=16)).save_pretrained(short)
    with pytest.raises(ValueError, match="teacher .*short has max_seq_len 16, shorter than this run's rows of 32"):
        Trainer(tiny_train_config(train_root, tmp_path / "c", teacher=str(short)))
    odd = tmp_path / "odd"  # a transformers config whose fields have the wrong types
    odd.mkdir()
    cases = (({"model_type": ["llama"]}, r"a transformers \['llama'\] checkpoint"),
             ({"model_type": "llama", "num_hidden_layers": "32"}, "num_hidden_layers='32'"))
    for raw, error in cases:
        (odd / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ValueError, match=error):
            load_teacher(odd)


def test_the_cli_distils_and_writes_a_cache_only(train_root, teacher_dir, tmp_path, capsys):
    flags = ["train", "--init-from", str(teacher_dir), "--data", str(train_root / "corpus"),
             "--data-dir", str(train_root / "data"), "--val-fraction", "0.1", "--keep-all", "--seq-len", "32",
             "--batch-size", "4", "--eval-batches", "1", "--eval-depths", "1", "--no-tensorboard", "--no-progress",
             "--teacher", str(teacher_dir), "--teacher-depth", "1", "--distill-top-k", "4",
             "--depth-scheme", "fixed", "--mean-recurrence", "4"]
    assert main([*flags, "--out", str(tmp_path / "only"), "--distill-cache", str(tmp_path / "cache"),
                 "--distill-cache-only"]) == 0
    assert "16 bytes per token" in capsys.readouterr().out
    assert main([*flags, "--out", str(tmp_path / "run"), "--distill-cache", str(tmp_path / "cache"),
                 "--max-steps", "1"]) == 0
    assert (tmp_path / "run" / "model" / "config.json").is_file()



def write_llama_dir(path, vocab=64, hidden=32, ffn=40, layers=4, heads=4, kv_heads=2):
    """A transformers-format Llama directory written by hand (config.json + safetensors, random weights)."""
    from safetensors.torch import save_file

    path.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 32,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    gen, head_dim = torch.Generator().manual_seed(0), hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        block = f"model.layers.{i}."
        shapes.update({block + "input_layernorm.weight": (hidden,),
                       block + "post_attention_layernorm.weight": (hidden,),
                       block + "self_attn.q_proj.weight": (hidden, hidden),
                       block + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       block + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       block + "self_attn.o_proj.weight": (hidden, hidden),
                       block + "mlp.gate_proj.weight": (ffn, hidden), block + "mlp.up_proj.weight": (ffn, hidden),
                       block + "mlp.down_proj.weight": (hidden, ffn)})
    save_file({name: torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()},
              str(path / "model.safetensors"))


def test_a_non_recurrent_teacher_runs_at_depth_one_through_retrofit(tmp_path):
    """A transformers Llama directory as teacher: retrofit with every layer kept (tests/test_retrofit.py shows
    that equals the source network), run at depth 1, deterministic, in eval mode without gradients."""
    write_llama_dir(tmp_path / "llama")
    with pytest.raises(ValueError, match="teacher_depth=4: teacher .* is not recurrent"):
        load_teacher(tmp_path / "llama", 4)
    teacher = load_teacher(tmp_path / "llama")
    assert teacher.depth == 1 and teacher.vocab_size == 64 and not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    objective = Distillation(teacher, alpha=0.5, temperature=1.0, top_k=0, seed=0, position=lambda: 0)
    first = objective.teacher_logits(ids, position=0)
    assert first.shape == (2, 9, 64) and torch.equal(first, objective.teacher_logits(ids, position=5))


class RowsOnly:
    """A stand-in for a ShardDataset: `len`, `row_len` and `rows(indices)` in storage order."""

    def __init__(self, num_rows, row_len=5):
        self.data = (torch.arange(num_rows * row_len).reshape(num_rows, row_len) % VOCAB).numpy()
        self.row_len = row_len

    def __len__(self):
        return len(self.data)

    def rows(self, indices):
        return self.data[list(indices)]


def random_teacher(input_ids, first_row):
    return torch.randn(*input_ids.shape, VOCAB, generator=torch.Generator().manual_seed(first_row))


def test_a_cache_write_killed_mid_shard_leaves_no_torn_shard_and_no_manifest(tmp_path, monkeypatch):
    import numpy as np

    from recurrent_depth.train import distill_cache

    monkeypatch.setattr(distill_cache, "ROWS_PER_SHARD", 2)
    real_write, calls = np.lib.format.write_array, []

    def killed_on_the_second_shard(fp, array, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # values of shard 1: some bytes written, then the process dies
            fp.write(b"\x93NUMPY partial")
            raise KeyboardInterrupt
        return real_write(fp, array, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", killed_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        distill_cache.write_cache(random_teacher, RowsOnly(4), tmp_path / "cache", top_k=3, vocab_size=VOCAB,
                                  data_key="k", teacher_info={}, batch_size=2, log=lambda _: None)
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert names == [".write.lock", "indices_00000.npy", "progress.json", "values_00000.npy"]  # whole shards only
    assert not distill_cache.has_cache(tmp_path / "cache")


def test_an_interrupted_cache_write_resumes_after_its_last_whole_shard(tmp_path, monkeypatch):
    import numpy as np

    from recurrent_depth.train import distill_cache

    monkeypatch.setattr(distill_cache, "ROWS_PER_SHARD", 2)
    options = dict(top_k=3, vocab_size=VOCAB, data_key="k", teacher_info={}, batch_size=2, log=lambda _: None)
    distill_cache.write_cache(random_teacher, RowsOnly(6), tmp_path / "whole", **options)
    seen = []

    def dies_on_the_third_shard(input_ids, first_row):
        seen.append(first_row)
        if first_row == 4:
            raise KeyboardInterrupt
        return random_teacher(input_ids, first_row)

    with pytest.raises(KeyboardInterrupt):
        distill_cache.write_cache(dies_on_the_third_shard, RowsOnly(6), tmp_path / "cache", **options)
    # a shard file renamed whole but not yet listed (killed between values and indices) is written again
    (tmp_path / "cache" / "values_00002.npy").write_bytes(b"\x93NUMPY partial")
    seen.clear()
    distill_cache.write_cache(lambda ids, first: seen.append(first) or random_teacher(ids, first), RowsOnly(6),
                              tmp_path / "cache", **options)
    assert seen == [4]  # the two whole shards were kept: the old code started over at row 0
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert "progress.json" not in names and distill_cache.has_cache(tmp_path / "cache")
    for name in names:
        if name.endswith(".npy"):
            assert np.array_equal(np.load(tmp_path / "cache" / name), np.load(tmp_path / "whole" / name)), name
    assert (tmp_path / "cache" / "manifest.json").read_text() == (tmp_path / "whole" / "manifest.json").read_text()
    # progress from other settings (another teacher depth) is not resumed
    with pytest.raises(KeyboardInterrupt):
        distill_cache.write_cache(dies_on_the_third_shard, RowsOnly(6), tmp_path / "other", **options)
    seen.clear()
    distill_cache.write_cache(lambda ids, first: seen.append(first) or random_teacher(ids, first), RowsOnly(6),
                              tmp_path / "other", **{**options, "teacher_info": {"depth": 8}})
    assert seen == [0, 2, 4]


def test_a_cache_of_a_teacher_retrained_in_place_is_written_again_and_says_why(train_root, teacher_dir, tmp_path):
    """The cache named its teacher by directory, depth and vocabulary only, and a finished cache was never checked
    against the teacher: one retrained in place kept serving the old teacher's logits. Its identity (config.json
    and the weight files' names, sizes, mtimes) is in the manifest; a changed teacher's cache is written again."""
    import os
    import shutil

    import numpy as np

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir, teacher)
    options = dict(max_steps=1, teacher=str(teacher), teacher_depth=1, distill_top_k=4, distill_cache_only=True,
                   distill_cache=str(tmp_path / "cache"))
    values = tmp_path / "cache" / "values_00000.npy"

    def cache_run(name):
        messages = []
        Trainer(tiny_train_config(train_root, tmp_path / name, **options), log=messages.append)
        return [m for m in messages if "out of date" in m], np.load(values)

    said, first = cache_run("a")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert len(manifest["teacher"]["identity"]) == 64 and said == []
    assert cache_run("b")[0] == []  # the same teacher: the cache is reused
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text()) == manifest
    torch.manual_seed(12)  # "retrained": other weights, the same directory
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        teacher, tokenizer=train_root / "tokenizer")
    os.utime(teacher / "model.safetensors", ns=(1, 1))  # (a new mtime even on a coarse-grained clock)
    said, second = cache_run("c")
    assert said == [f"distill cache: {tmp_path / 'cache'} is out of date (the teacher {teacher} changed since (its "
                    "config.json or weight files differ)): writing it again"]
    assert not np.array_equal(first, second)
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["teacher"]["identity"] != \
        manifest["teacher"]["identity"]
    assert cache_run("d")[0] == []


def test_a_cache_is_written_again_for_another_batch_size_refused_for_another_seed_and_reused_for_other_settings(
        train_root, teacher_dir, tmp_path):
    """A finished cache was checked against the teacher's identity and depth only: a run with another batch size
    silently reused rows whose teacher initial states were drawn in other batches. That writes the cache again now,
    saying why; another seed (other rows too) is refused naming the seed; what the cache does not depend on
    (learning rate, temperature, alpha) reuses it."""
    import numpy as np

    from recurrent_depth.train.optim import OptimConfig

    cache = tmp_path / "cache"
    base = dict(max_steps=1, teacher=str(teacher_dir), teacher_depth=1, distill_top_k=4, distill_cache_only=True,
                distill_cache=str(cache))

    def cache_run(name, **changes):
        messages = []
        Trainer(tiny_train_config(train_root, tmp_path / name, **{**base, **changes}), log=messages.append)
        return [m for m in messages if "out of date" in m], np.load(cache / "values_00000.npy")

    said, first = cache_run("a")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert said == [] and manifest["teacher"]["random_state"] is True
    optim = OptimConfig.from_preset("demo", lr=1e-4, warmup_steps=2, cooldown_fraction=0.25)
    assert cache_run("b", optim=optim, distill_temperature=2.0, distill_alpha=0.9)[0] == []  # reused as it is
    assert json.loads((cache / "manifest.json").read_text()) == manifest
    said, second = cache_run("c", batch_size=2)  # (the same rows: the batch size is not in the data key)
    assert said == [f"distill cache: {cache} is out of date (its teacher's initial states were drawn per batch of 4 "
                    f"rows, this run's batch_size is 2): writing it again"]
    assert not np.array_equal(first, second)
    # Another seed also splits and packs the documents: a cache of other rows, refused for every teacher (as for a
    # teacher whose initial state is not random), naming the seed; tests/test_distill2_s36.py checks that.
    with pytest.raises(ValueError, match="its data_key is .* written with seed 0, this run's is 1"):
        cache_run("d", batch_size=2, seed=1)
    assert np.array_equal(np.load(cache / "values_00000.npy"), second)  # (not written over)


def test_a_truncated_cache_shard_is_a_one_line_error(tmp_path):
    from recurrent_depth.train import distill_cache

    data = RowsOnly(4)
    distill_cache.write_cache(random_teacher, data, tmp_path / "cache", top_k=3, vocab_size=VOCAB, data_key="k",
                              teacher_info={}, batch_size=2, log=lambda _: None)
    options = dict(top_k=3, vocab_size=VOCAB, data_key="k")
    assert distill_cache.CachedTeacher(tmp_path / "cache", data, **options).lookup(data.data[2]) == 2
    shard = tmp_path / "cache" / "values_00000.npy"
    for size in (shard.stat().st_size - 7, 0):  # cut inside the data, then an empty file
        with open(shard, "r+b") as handle:
            handle.truncate(size)
        with pytest.raises(ValueError, match=r"values_00000.npy is truncated or damaged .*the cache is incomplete; "
                                             r"delete .* to write it again") as info:
            distill_cache.CachedTeacher(tmp_path / "cache", data, **options)
        assert "\n" not in str(info.value)
