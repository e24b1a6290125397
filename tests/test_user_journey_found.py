"""Bugs found by following the README and docs/ as a new user (train -> generate -> export; retrofit -> sft ->
LoRA -> merge -> serve -> lm-eval; rl), each with the check that failed before its fix."""

from __future__ import annotations

import json
import warnings

import pytest


def test_a_transformers_saved_generation_config_is_read_without_a_warning(tmp_path, capsys):
    """transformers 5 writes output_attentions / output_hidden_states / use_cache into every generation_config.json
    it derives from a model config; a retrofit copies that file, so every `rdepth generate` and `serve` of a
    retrofitted model warned that it sets settings rdepth does not run. At those values they ask for nothing."""
    from recurrent_depth.generation_config import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "output_attentions": False,
        "output_hidden_states": False, "pad_token_id": 3, "transformers_version": "5.25.0", "use_cache": True}))
    assert generation_defaults(str(tmp_path), "auto", "rdepth generate") == {"eos_token_id": 2}
    assert capsys.readouterr().err == ""
    # another value still asks for something this command does not do, and is named
    (tmp_path / "generation_config.json").write_text(json.dumps({"use_cache": False, "output_attentions": True}))
    generation_defaults(str(tmp_path), "auto", "rdepth generate")
    assert "sets ['output_attentions', 'use_cache'], which rdepth generate does not run" in capsys.readouterr().err


def test_loop_pretrain_shorter_than_its_warmup_does_not_warn_about_a_setting_it_has_no_flag_for(tmp_path,
                                                                                                monkeypatch):
    """`rdepth loop pretrain --max-steps 10` warned "TrainConfig.optim.warmup_steps=30 is longer than the run":
    the demo's own warmup, which the command offers no flag to change. A shorter run now warms up over its steps."""
    import recurrent_depth.train.trainer as trainer_module
    from recurrent_depth.looping.pretrain import PretrainRecipe, pretrain
    from recurrent_depth.train.config import UnusedSettingWarning

    seen = {}

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, cfg, **kwargs):
            seen["cfg"] = cfg
            raise Stop

    monkeypatch.setattr(trainer_module, "Trainer", Recorder)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"{i}.txt").write_text(" ".join(f"word{j % 37} thing{(j * i) % 11}" for j in range(400)))
    recipe = PretrainRecipe(data=str(data), vocab_size=300, hidden_size=16, num_layers=2, num_heads=2,
                            num_kv_heads=1, intermediate_size=32, seq_len=16, batch_size=2, max_steps=3,
                            val_fraction=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedSettingWarning)
        with pytest.raises(Stop):
            pretrain(tmp_path / "out", recipe, log=lambda _: None)
    assert seen["cfg"].optim.warmup_steps == 3 and seen["cfg"].max_steps == 3


def test_eval_prints_every_fewshot_count(tmp_path, monkeypatch):
    """`rdepth eval --fewshot 0,1` measured and stored both counts but printed only the first count's lines,
    unlabelled."""
    import recurrent_depth as rd
    from recurrent_depth.evaluation import depth_eval

    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).save_pretrained(tmp_path / "m")
    monkeypatch.setattr(depth_eval, "_task_manager", lambda config: None)
    monkeypatch.setattr(depth_eval, "_lm_eval", lambda path, config, depths, k, manager, baseline=False:
                        {"rd_task/acc": {d: 0.25 * (k + 1) for d in depths}})
    said: list[str] = []
    results = depth_eval.evaluate_depths(depth_eval.EvalConfig(
        model=str(tmp_path / "m"), depths=[1, 2], out=str(tmp_path / "out"), data=None,
        lm_eval_tasks=["rd_task"], fewshot=[0, 1]), log=said.append)
    assert set(results["lm_eval"]) == {"0", "1"}
    assert "  rd_task/acc (0-shot): r=1: 0.250  r=2: 0.250" in said
    assert "  rd_task/acc (1-shot): r=1: 0.500  r=2: 0.500" in said
