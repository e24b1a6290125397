"""Post-hoc EMA over checkpoints (`rdepth average`)."""

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.train.averaging import average_checkpoints, ema_state, select_checkpoints


def _save_models(root, count):
    paths, states = [], []
    for i in range(count):
        torch.manual_seed(i)
        model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
        path = root / "checkpoints" / f"step-{(i + 1) * 10:08d}"
        model.save_pretrained(path)
        for name in ("optimizer.safetensors", "optimizer.json", "trainer_state.json"):
            (path / name).write_text("{}")  # the other files of a training checkpoint
        (path / "tokenizer.json").write_text('{"marker": "the run\'s tokenizer"}')  # (a run's checkpoints share it)
        paths.append(path)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return paths, states


@pytest.mark.parametrize(
    "count, last, dilation, expected",
    [(10, 3, 1, [7, 8, 9]), (10, 3, 3, [3, 6, 9]), (5, 10, 2, [0, 2, 4]), (4, 1, 1, [3])],
    ids=["last3", "dilated3", "fewer-than-asked", "newest-only"],
)
def test_selection_counts_back_from_the_newest(count, last, dilation, expected):
    assert select_checkpoints(list(range(count)), last, dilation) == expected


def test_ema_matches_the_formula(tmp_path):
    paths, states = _save_models(tmp_path, 3)
    beta = 0.9
    got = ema_state(paths, beta)
    assert set(got) == set(states[0]) - {"lm_head.weight"}  # the tied head is stored once
    for name in got:
        expected = states[0][name].clone()
        for later in states[1:]:
            expected = beta * expected + (1 - beta) * later[name]
        torch.testing.assert_close(got[name], expected, rtol=1e-6, atol=1e-7)


def test_cli_averages_a_run_into_a_loadable_model_dir(tmp_path, capsys):
    paths, states = _save_models(tmp_path / "run", 4)
    out = tmp_path / "ema"
    assert main(["average", "--run", str(tmp_path / "run"), "--last", "2", "--dilation", "2", "--beta", "0.5",
                 "--out", str(out)]) == 0
    assert "step-00000020" in capsys.readouterr().out
    model = rd.RecurrentDepthLM.from_pretrained(out)
    wte = model.state_dict()["transformer.wte.weight"]
    expected = 0.5 * states[1]["transformer.wte.weight"] + 0.5 * states[3]["transformer.wte.weight"]
    torch.testing.assert_close(wte, expected)
    assert (out / "tokenizer.json").read_text() == (paths[0] / "tokenizer.json").read_text()


def test_bad_arguments_are_clean_errors(tmp_path, capsys):
    paths, _ = _save_models(tmp_path, 2)
    with pytest.raises(ValueError, match="beta"):
        average_checkpoints(paths, tmp_path / "o", beta=1.0)
    with pytest.raises(ValueError, match="dilation"):
        select_checkpoints(paths, 2, 0)
    assert main(["average", "--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "no complete checkpoints" in capsys.readouterr().err
    other = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", hidden_size=32))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="different config"):
        ema_state([paths[0], tmp_path / "other"])


def test_output_over_an_input_checkpoint_or_a_missing_tokenizer_is_refused(tmp_path):
    """Writing the average over one of its inputs would replace a training checkpoint's weights; a named
    tokenizer directory without tokenizer files would silently give a model directory without one."""
    paths, _ = _save_models(tmp_path, 2)
    before = (paths[1] / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="one of the checkpoints"):
        average_checkpoints(paths, paths[1])
    assert (paths[1] / "model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="tokenizer_dir"):
        average_checkpoints(paths, tmp_path / "o", tokenizer_dir=tmp_path / "nowhere")
    assert not (tmp_path / "o").exists()


def test_output_over_a_checkpoint_left_out_of_the_average_is_refused(tmp_path, capsys):
    """`--last 1 --out <an older checkpoint>` replaced that checkpoint's weights, so --resume found it damaged."""
    paths, _ = _save_models(tmp_path / "run", 3)
    before = (paths[0] / "model.safetensors").read_bytes()
    assert main(["average", "--run", str(tmp_path / "run"), "--last", "1", "--out", str(paths[0])]) == 2
    err = capsys.readouterr().err
    assert "is a training checkpoint" in err and len(err.strip().splitlines()) == 1
    assert (paths[0] / "model.safetensors").read_bytes() == before


def test_output_into_the_run_directory_itself_is_refused(tmp_path, capsys):
    """`rdepth average --run R --out R` wrote config.json and model.safetensors beside run.json and
    checkpoints/, so `--model R` then loaded the average instead of the run's model/."""
    paths, _ = _save_models(tmp_path / "run", 2)
    (tmp_path / "run" / "run.json").write_text("{}")
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "is a training run directory" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert not (tmp_path / "run" / "config.json").exists()


def test_help_labels_the_ema_direction_as_an_assumption(capsys):
    with pytest.raises(SystemExit):
        main(["average", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "oldest first" in text and "is an assumption" in text


def test_a_lora_runs_checkpoints_are_refused_in_one_line(tmp_path, capsys):
    """A LoRA run's checkpoints hold the peft-wrapped state (`base_model.model...lora_A.default...`): their
    average was written under those names, a model directory that no loader could read."""
    pytest.importorskip("peft")
    from safetensors.torch import save_file

    from recurrent_depth.train.lora import LoraSpec, add_lora, save_adapter

    paths, _ = _save_models(tmp_path / "run", 2)
    for path in paths:
        peft_model = add_lora(rd.RecurrentDepthLM.from_pretrained(path), LoraSpec(rank=2, parts=("core",)),
                              base_dir=path, seed=0)
        save_adapter(peft_model, path)  # adapter_config.json + adapter_model.safetensors, as a LoRA run writes
        save_file({k: v.detach().clone() for k, v in peft_model.state_dict().items()}, str(path / "model.safetensors"))
    out = tmp_path / "ema"
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "LoRA run's checkpoint" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_run_started_from_a_bf16_directory_averages_into_bf16(tmp_path, capsys):
    """Checkpoints keep the trained float32; the run's model/ (and so its average) is in --init-from's dtype."""
    import json

    _save_models(tmp_path / "run", 2)
    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).to(torch.bfloat16).save_pretrained(tmp_path / "start")
    (tmp_path / "run" / "run.json").write_text(json.dumps({"config": {"init_from": str(tmp_path / "start")}}))
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "ema")]) == 0
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "ema").dtype == torch.bfloat16
    (tmp_path / "run" / "run.json").write_text(json.dumps({"config": {"init_from": None}}))  # from scratch: as stored
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "ema32")]) == 0
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "ema32").dtype == torch.float32


def test_checkpoints_of_other_tokenizers_are_refused_unless_one_is_chosen(tmp_path, capsys):
    """The tokenizer was copied from the newest checkpoint whatever the others held: an average of checkpoints of
    other tokenizers (other token ids) came out under one of them without a word."""
    paths, _ = _save_models(tmp_path / "run", 2)
    (paths[0] / "tokenizer.json").write_text('{"marker": "another tokenizer"}')
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "ema")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot average {paths[0]} and {paths[1]}: they hold different tokenizer.json (other token ids" in err
    assert "\n" not in err and not (tmp_path / "ema").exists()
    assert main(["average", "--run", str(tmp_path / "run"), "--tokenizer", str(paths[0]), "--out",
                 str(tmp_path / "ema")]) == 0
    assert (tmp_path / "ema" / "tokenizer.json").read_text() == '{"marker": "another tokenizer"}'


def _retrofitted_model(tmp_path):
    """A tiny Qwen3 retrofitted by `rdepth retrofit` (its tokenizer, retrofit.json), with generation defaults."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    specials = special_token_ids(tok)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        bos_token_id=specials["begin_text"], eos_token_id=specials["end_text"], pad_token_id=specials["pad"],
    )).save_pretrained(tmp_path / "qwen3")
    save_tokenizer(tok, tmp_path / "qwen3")
    out = tmp_path / "retrofitted"
    assert main(["retrofit", "--model", str(tmp_path / "qwen3"), "--prelude", "1", "--core", "1:3", "--coda", "1",
                 "--out", str(out), "--threads", "1"]) == 0
    (out / "generation_config.json").write_text('{"max_new_tokens": 2, "num_steps": 1}\n')
    return out


def test_an_average_of_a_retrofitted_model_keeps_what_its_inputs_carry(tmp_path, capsys):
    """`rdepth average` kept the weights and the tokenizer only: retrofit.json (where the model came from) and
    generation_config.json (its generation defaults) were lost, so the average generated otherwise than its inputs
    and exported without its record. An average of two copies of one retrofitted model now generates and exports
    exactly as that model; copies that disagree on a kept file are refused in one line."""
    import shutil

    from recurrent_depth.families.retrofit import PROVENANCE_FILE

    model = _retrofitted_model(tmp_path)
    shutil.copytree(model, tmp_path / "again")
    capsys.readouterr()
    out = tmp_path / "ema"
    assert main(["average", "--checkpoints", str(model), str(tmp_path / "again"), "--out", str(out)]) == 0
    for name in (PROVENANCE_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (out / name).read_bytes() == (model / name).read_bytes(), name
    capsys.readouterr()
    said = []
    for directory in (model, out):
        assert main(["generate", "--model", str(directory), "--prompt", "def f(x):", "--threads", "1"]) == 0
        said.append(capsys.readouterr().out)
    assert said[0] == said[1]
    for directory, exported in ((model, tmp_path / "export-model"), (out, tmp_path / "export-ema")):
        assert main(["export", "--model", str(directory), "--out", str(exported)]) == 0
    files = sorted(path.name for path in (tmp_path / "export-model").iterdir())
    assert PROVENANCE_FILE in files and sorted(path.name for path in (tmp_path / "export-ema").iterdir()) == files
    for name in files:
        assert (tmp_path / "export-ema" / name).read_bytes() == (tmp_path / "export-model" / name).read_bytes(), name
    (tmp_path / "again" / "generation_config.json").write_text('{"max_new_tokens": 5}\n')
    assert main(["average", "--checkpoints", str(model), str(tmp_path / "again"), "--out",
                 str(tmp_path / "ema2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "they hold different generation_config.json (other generation defaults" in err and "\n" not in err


def _files(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}


def test_a_refused_average_leaves_a_model_already_in_out_as_it_was(tmp_path, capsys):
    """The tokenizer files of `out` were deleted and the new ones written before the kept files were read: a
    retrofit.json over the size limit or a FIFO in --tokenizer left a model already there without its tokenizer
    (or with another beside its old weights); --tokenizer OUT --out OUT lost OUT's tokenizer."""
    import os

    paths, _ = _save_models(tmp_path / "run", 2)
    out = tmp_path / "ema"
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(out)]) == 0
    before = _files(out)
    for path in paths:  # (the same in both: agreed; over the 16 MiB a kept file may have)
        (path / "retrofit.json").write_bytes(b" " * (17 << 20))
    assert main(["average", "--run", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "retrofit.json has 17,825,792 bytes, more than the 16,777,216 allowed" in err and "\n" not in err
    assert _files(out) == before
    for path in paths:
        (path / "retrofit.json").unlink()
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"marker": "another tokenizer"}')
    os.mkfifo(tokenizer / "tokenizer_config.json")
    assert main(["average", "--run", str(tmp_path / "run"), "--tokenizer", str(tokenizer), "--out", str(out)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert _files(out) == before
    assert main(["average", "--run", str(tmp_path / "run"), "--tokenizer", str(out), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == before["tokenizer.json"]


@pytest.mark.parametrize("special", ["dangling", "fifo", "dev-zero"])
def test_a_kept_file_that_is_no_regular_file_is_refused_in_one_line(tmp_path, capsys, special):
    """As a run's start refuses it (`integrations.export.read_companions`): a dangling link was taken for no file,
    without a word."""
    import os

    paths, _ = _save_models(tmp_path / "run", 2)
    for name in ("generation_config.json", "retrofit.json"):
        target = paths[0] / name
        if special == "dangling":
            target.symlink_to(tmp_path / "gone.json")
        elif special == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero")
        assert main(["average", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "ema")]) == 2
        err = capsys.readouterr().err.strip()
        assert name in err and "not a regular file" in err and "\n" not in err, err
        assert not (tmp_path / "ema").exists()
        target.unlink()
