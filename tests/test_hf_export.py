"""`rdepth export --remote-code`: the exported directory loads in a process that never imports recurrent_depth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.integrations.export import REMOTE_CODE_FILE
from tests.test_hf import check_attentions, greedy_reference, ids, make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("per_head", [False, True], ids=["shared-qk-gain", "per-head-qk-gains"])
def test_remote_code_export_loads_without_the_library(tmp_path, per_head):
    # GQA, QK-norm (both gain shapes) and a sliding window exercise every branch of the standalone attention.
    model = make_model_dir(tmp_path / "src", num_kv_heads=2, qk_norm=True, qk_norm_per_head=per_head,
                           mixer_options={"window": 5})
    with torch.no_grad():  # distinct gains per head and per dim, so a wrong broadcast would show
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.5)
    model.save_pretrained(tmp_path / "src")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_recurrent_depth.RecurrentDepthForCausalLM"
    assert (out / REMOTE_CODE_FILE).is_file() and (out / "chat_template.jinja").is_file()
    x = ids(batch=2, length=9)
    with torch.no_grad():
        fixed = model(x, num_steps=3, init_scale=0.0).logits
        torch.manual_seed(5)
        random_s0 = model(x, num_steps=3).logits
    greedy = greedy_reference(model, x, 5, 3)
    torch.save({"x": x, "fixed": fixed, "random_s0": random_s0, "greedy": greedy}, tmp_path / "expected.pt")

    script = textwrap.dedent(f"""
        import sys
        sys.modules["recurrent_depth"] = None  # make any import of the library fail loudly
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(1)
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ref = torch.load({str(tmp_path / "expected.pt")!r})
        x = ref["x"]
        with torch.no_grad():
            assert torch.equal(model(x, num_steps=3, init_scale=0.0).logits, ref["fixed"])
            loss = model(x, labels=x.int(), num_steps=3, init_scale=0.0).loss  # (int32 labels failed in the loss)
            assert torch.equal(loss, model(x, labels=x, num_steps=3, init_scale=0.0).loss)
            torch.manual_seed(5)
            assert torch.equal(model(x, num_steps=3).logits, ref["random_s0"])
        out = model.generate(x, max_new_tokens=5, num_steps=3, init_scale=0.0, do_sample=False)
        assert torch.equal(out, ref["greedy"]), (out, ref["greedy"])
        assert AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True).chat_template
        for adaptive in (dict(criterion="kl"), dict(kv_budget=2), dict(continuous_compute=True)):
            try:
                model.generate(x, max_new_tokens=2, num_steps=3, **adaptive)
            except ValueError as exc:
                assert "runs at a fixed depth only" in str(exc) and "import recurrent_depth" in str(exc), exc
            else:
                raise AssertionError(f"{{adaptive}} was accepted")
        print("ok")
    """)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr  # no interactive question


def test_the_remote_file_names_every_option_it_does_not_run():
    """Issue 33 item 3: the list the standalone file refuses is the library's: every generate option
    beyond transformers' own loop at a fixed depth, by our names and the official ones."""
    from recurrent_depth.inference.schema import OFFICIAL_ALIASES, OPTIONS, names_for
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    runs_here = set(names_for("hf", "shared")) - {"kv_budget", "kv_policy"}  # depth, init scale, sampling
    # transformers' own eos and output_logits flag; the library's teacher forcing
    not_a_kwarg = {"eos_token_id", "output_logits", "teacher_tokens"}
    library_only = set(OPTIONS) - runs_here - not_a_kwarg | set(OFFICIAL_ALIASES) | {"cache_kwargs"}
    assert set(remote.LIBRARY_ONLY_OPTIONS) == library_only
    with pytest.raises(ValueError, match=r"^criterion, exit_threshold: this exported model .* fixed depth only"):
        remote.refuse_library_only({"criterion": "kl", "exit_threshold": 1e-3, "num_steps": 4})
    # a static cache is refused for what it is, not for the depth; input_states (one forward's s_0) up front
    with pytest.raises(ValueError, match=r"^cache_implementation: this exported model keeps its keys and values in "
                                         r"its own dynamic cache .* static cache needs the recurrent_depth library"):
        remote.refuse_library_only({"cache_implementation": "static"})
    with pytest.raises(ValueError, match=r"^generate: input_states is a forward\(\) argument"):
        remote.refuse_library_only({"input_states": torch.zeros(1, 3, 64)})


def test_export_converts_dtype_and_shards_in_the_library_layout(tmp_path):
    model = make_model_dir(tmp_path / "src")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "bf16"),
                 "--dtype", "bfloat16", "--max-shard-mb", "0.05"]) == 0
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "bf16" / "tokenizer.json").is_file()
    as_bf16 = rd.RecurrentDepthLM(model.config).eval()
    as_bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded.float()(x, num_steps=2, init_scale=0.0).logits,
                           as_bf16(x, num_steps=2, init_scale=0.0).logits)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--remote-code"], "supports the 'attention' mixer only"),
        ([], "--out is required"),
        (["--out", "X", "--max-shard-mb", "0"], "--max-shard-mb=0"),
        (["--out", "X", "--max-shard-mb", "inf"], "--max-shard-mb=inf is invalid"),  # was an OverflowError
        (["--out", "X", "--max-shard-mb", "nan"], "--max-shard-mb=nan is invalid"),  # was int()'s ValueError
    ],
    ids=["other-mixer", "no-out", "bad-shard-size", "infinite-shard-size", "nan-shard-size"],
)
def test_export_errors_are_clear(tmp_path, capsys, argv, message):
    make_model_dir(tmp_path / "src", with_tokenizer=False, mixer={"core": "linear_attention"})
    assert main(["export", "--model", str(tmp_path / "src"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_export_takes_a_tokenizer_json_file_as_its_help_says(tmp_path):
    # "--tokenizer DIR: tokenizer directory (or tokenizer.json)", but a file was refused.
    make_model_dir(tmp_path / "src", with_tokenizer=False)
    make_model_dir(tmp_path / "tok")
    assert main(["export", "--model", str(tmp_path / "src"), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                 "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("argv", [["--remote-code"], ["--dtype", "float32"]], ids=["remote-code", "re-saved"])
def test_export_keeps_the_generation_defaults(tmp_path, argv):
    """generation_config.json (num_steps, eos_token_id, max_new_tokens set on `model.generation_config` and saved)
    was left behind: the exported copy generated at another depth, to another length, past another stop token."""
    from transformers import AutoModelForCausalLM

    make_model_dir(tmp_path / "src", with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    model.generation_config.update(num_steps=1, init_scale=0.0, eos_token_id=[257, 10], max_new_tokens=5)
    model.save_pretrained(tmp_path / "src")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), *argv]) == 0
    assert (json.loads((tmp_path / "out" / "generation_config.json").read_text())
            == json.loads((tmp_path / "src" / "generation_config.json").read_text()))
    x = ids(batch=1, length=6)
    expected = model.generate(x, do_sample=False)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "out").generate(x, do_sample=False), expected)


def test_remote_code_export_refuses_generation_defaults_only_the_library_runs(tmp_path, capsys):
    """A generation_config.json with an exit criterion was copied: the exported file then refused every plain
    `generate` call. Refused before anything is written."""
    make_model_dir(tmp_path / "src", with_tokenizer=False)
    (tmp_path / "src" / "generation_config.json").write_text(json.dumps({"exit_criterion": "kl", "num_steps": 4}))
    for dtype in ([], ["--dtype", "bfloat16"]):  # (a re-save first, then the remote-code files)
        assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code",
                     *dtype]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "generation_config.json sets ['exit_criterion'], which only the recurrent_" in err[0]
        assert not (tmp_path / "out").exists()
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--dtype",
                 "float32"]) == 0  # (the library reads it: a plain re-save keeps it)


def test_export_to_an_existing_file_names_it(tmp_path, capsys):
    make_model_dir(tmp_path / "src", with_tokenizer=False)
    (tmp_path / "file").write_text("keep")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is an existing file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "keep"


def test_the_remote_file_knows_huginns_architecture_values_as_the_library_does():
    """The standalone file refuses any other architecture; its copies of Huginn's values and of the longest window
    the library accepts must not drift."""
    from recurrent_depth.config import HUGINN_ARCHITECTURE, MAX_SEQ_LEN
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert remote.HUGINN_ARCHITECTURE == HUGINN_ARCHITECTURE
    assert remote.MAX_WINDOW == MAX_SEQ_LEN


def test_remote_file_refuses_bad_ids_in_one_line_and_keeps_output_logits(tmp_path):
    """An id outside the vocabulary or an empty prompt was an IndexError from the embedding (or from
    transformers' generate); `output_logits=True`, transformers' own flag, was refused as library-only."""
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    model = make_model_dir(tmp_path / "src")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    vocab = model.config.vocab_size
    for bad, message in ((torch.tensor([[1, vocab]]), rf"^token id {vocab} at \(row 0, position 1\) is outside"),
                         (torch.tensor([[-1]]), r"^token id -1 at \(row 0, position 0\) is outside"),
                         (torch.zeros(1, 0, dtype=torch.long), r"^input_ids must have shape \[batch, seq_len>0\]")):
        with pytest.raises(ValueError, match=message):
            exported(bad, num_steps=2)
        with pytest.raises(ValueError, match=message):
            exported.generate(bad, max_new_tokens=2, num_steps=2, do_sample=False)
    x = ids(batch=1, length=5)
    out = exported.generate(x, max_new_tokens=3, num_steps=2, init_scale=0.0, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_reference(model, x, 3, 2))
    with torch.no_grad():
        full = model(out.sequences, num_steps=2, init_scale=0.0).logits[0]
    for i, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits[0], full[x.shape[1] - 1 + i], atol=1e-5, rtol=1e-5)


def test_remote_file_runs_per_layer_windows_as_the_library(tmp_path):
    """`rdepth export --remote-code` refused a model with per-layer windows (`attention_windows`); the exported
    file now windows each layer as the library does: logits with left padding, and greedy generate (cached)
    past every window equal the library's."""
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    model = make_model_dir(tmp_path / "src", with_tokenizer=False, num_kv_heads=2, attention_windows=[3, None, 2, 4])
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert [b.attn.window for b in (*exported.transformer.prelude, *exported.transformer.core_block,
                                    *exported.transformer.coda)] == [3, None, 2, 4]
    x, mask = ids(batch=2, length=9), torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    with torch.no_grad():
        for m in (None, mask):
            torch.testing.assert_close(exported(x, attention_mask=m, num_steps=3, init_scale=0.0).logits,
                                       model(x, attention_mask=m, num_steps=3, init_scale=0.0).logits,
                                       atol=1e-5, rtol=1e-5)
    out = exported.generate(x, max_new_tokens=5, num_steps=3, init_scale=0.0, do_sample=False)
    assert torch.equal(out, greedy_reference(model, x, 5, 3))
    with pytest.raises(ValueError, match=r"^attention_windows=\[3\] is invalid: expected \[\] or 4 entries"):
        remote.RecurrentDepthConfig(attention_windows=[3])


def test_export_keeps_the_retrofit_record_and_reads_tokenizer_files_bounded(tmp_path, capsys):
    """Export copied the tokenizer files with an unbounded copy (one linked to /dev/zero filled the disk)
    and left retrofit.json, the record of the source a retrofitted model came from, behind."""
    make_model_dir(tmp_path / "src")
    (tmp_path / "src" / "retrofit.json").write_text('{"source": "a llama"}\n')
    for remote in ([], ["--remote-code"]):
        out = tmp_path / f"out{len(remote)}"
        assert main(["export", "--model", str(tmp_path / "src"), "--out", str(out), *remote]) == 0
        assert (out / "retrofit.json").read_text() == '{"source": "a llama"}\n'
        assert (out / "tokenizer.json").read_bytes() == (tmp_path / "src" / "tokenizer.json").read_bytes()
    if not os.path.exists("/dev/zero"):
        return
    (tmp_path / "src" / "tokenizer_config.json").unlink()
    os.symlink("/dev/zero", tmp_path / "src" / "tokenizer_config.json")
    capsys.readouterr()
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "zero")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tokenizer_config.json" in err
    assert not (tmp_path / "zero" / "model.safetensors").exists()  # no weights without their tokenizer


def test_export_refuses_a_retrofit_record_that_is_not_a_regular_file(tmp_path, capsys):
    """As a run's start and an average refuse it: export left a dangling retrofit.json out without a word (the
    copy lost the record of its source)."""
    make_model_dir(tmp_path / "src")
    os.symlink(tmp_path / "gone.json", tmp_path / "src" / "retrofit.json")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "retrofit.json is not a regular file" in err and "before exporting" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_remote_file_returns_the_attention_weights_it_uses(tmp_path):
    """output_attentions=True was dropped by the exported file (attentions None); now each attention call's
    weights, in the library's order and equal to the library's."""
    from transformers import AutoModelForCausalLM

    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    make_model_dir(tmp_path / "src", with_tokenizer=False, num_kv_heads=2, mixer_options={"window": 4})
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    x, mask = ids(batch=2, length=6), torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    check_attentions(exported, x, mask, num_steps=2, core_layers=exported.config.core_layers)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    with torch.no_grad():
        theirs = exported(x, attention_mask=mask, num_steps=2, init_scale=0.0, output_attentions=True).attentions
        library = ours(x, attention_mask=mask, num_steps=2, init_scale=0.0, output_attentions=True).attentions
    for a, b in zip(theirs, library, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    exported.double()  # a float64 model's weights came from float32 logits (off by ~1e-8 from the fast path)
    with torch.no_grad():
        flagged = exported(x, attention_mask=mask, num_steps=2, init_scale=0.0, output_attentions=True)
        fast = exported(x, attention_mask=mask, num_steps=2, init_scale=0.0)
    assert flagged.attentions[0].dtype == torch.float64
    torch.testing.assert_close(flagged.logits, fast.logits, atol=1e-10, rtol=1e-10)
