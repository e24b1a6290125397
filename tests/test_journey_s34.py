"""A user's journey through the CLI (Ouro, retrofit, train / sft / rl --init-from, LoRA, export, serve, info):
what it found that misled the user, each pinned."""

from __future__ import annotations

import dataclasses
import json

import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer


def test_a_finished_rl_run_resumed_names_updates_not_the_exit_bound(tmp_path, capsys):
    """`rdepth rl --resume` of a finished run said "raise --max-steps, --max-tokens or --max-minutes": rl counts
    its updates with --updates, has no --max-tokens / --max-minutes, and its --max-steps is the exit criterion's
    bound (raising it changes the rollouts, which the resume then refuses)."""
    torch.manual_seed(7)
    rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288)).save_pretrained(
        tmp_path / "m")
    byte_tokenizer().save(str(tmp_path / "m" / "tokenizer.json"))
    args = ["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1",
            "--difficulty", "2", "--group-size", "2", "--prompts-per-step", "1", "--updates", "1",
            "--max-new-tokens", "2", "--num-steps", "2"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    captured = capsys.readouterr()
    hint = next(line for line in (captured.err + captured.out).splitlines() if "nothing to do" in line)
    assert "raise --updates" in hint and "--max-steps" not in hint and "--max-minutes" not in hint


def test_an_adapter_given_as_a_model_names_its_base(tmp_path, capsys):
    """`rdepth info --model run/model` on a LoRA adapter said to load "its base model with it" but not which base;
    given the run directory instead, the same message named it (the adapter's base_model_name_or_path)."""
    adapter = tmp_path / "run" / "model"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base-7",
                                                             "peft_type": "LORA", "r": 8}))
    for given in (adapter, tmp_path / "run"):
        assert main(["info", "--model", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "it is a LoRA adapter" in err[0]
        assert f"(the adapter: {adapter}; its base: /models/base-7)" in err[0]


def test_a_gemma_checkpoint_is_pointed_to_retrofit_with_gemma_listed(tmp_path, capsys):
    """A transformers Gemma 2 directory given as --model was told to `rdepth retrofit` it, with a list of the
    types retrofit converts that left out Gemma 1 / 2 / 3, which it converts too (families/retrofit.py)."""
    from recurrent_depth.families.retrofit import SUPPORTED_MODEL_TYPES

    assert "gemma2" in SUPPORTED_MODEL_TYPES
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}))
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gemma2' checkpoint" in err[0] and "Gemma 1 / 2 / 3" in err[0]
