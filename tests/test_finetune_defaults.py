"""A run from a model directory that names no optimizer preset and no lr fine-tunes (not the demo's from-scratch
rate); anything named wins as before, and a run started with the old default resumes with it."""

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import build_parser
from recurrent_depth.cli.train import config_from_args
from recurrent_depth.data.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.init_from import resolved_config
from recurrent_depth.train.optim import OPTIM_PRESETS, OptimConfig
from recurrent_depth.train.trainer import Trainer
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config

DEMO, FINETUNE, LORA = OPTIM_PRESETS["demo"], OPTIM_PRESETS["finetune"], OPTIM_PRESETS["finetune-lora"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = prepare_root(tmp_path_factory.mktemp("finetune_root"))
    specials = special_token_ids(load_tokenizer(root / "tokenizer"))
    config = rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64, bos_token_id=specials["begin_text"],
                                        eos_token_id=eos_token_ids(specials), pad_token_id=specials["pad"])
    torch.manual_seed(0)
    rd.RecurrentDepthLM(config).save_pretrained(root / "model", tokenizer=root / "tokenizer")
    return root


def test_the_presets_fine_tune_with_the_papers_optimizer_at_a_small_rate():
    for preset in (FINETUNE, LORA):  # (the demo's optimizer: its state and resumes stay the same kind)
        assert preset.name == DEMO.name and preset.lr < DEMO.lr / 10 and preset.weight_decay == 0
        assert 0 < preset.warmup_steps < DEMO.warmup_steps and preset.cooldown_fraction
    assert FINETUNE.lr < LORA.lr


def test_a_run_from_a_model_directory_naming_no_preset_or_lr_fine_tunes():
    cfg = TrainConfig(init_from="base")
    assert cfg.optim == FINETUNE and cfg.optim_default == "finetune"
    lora = cfg.with_optim_for(lora=True)
    assert lora.optim == LORA and lora.optim_default == "finetune-lora" and lora.with_optim_for(lora=None) is lora
    # other optim settings go on top of the chosen preset, which follows the run (replace, LoRA)
    partial = TrainConfig(init_from="base", optim={"warmup_steps": 3})
    assert partial.optim == FINETUNE.updated(warmup_steps=3)
    assert partial.with_optim_for(lora=True).replace(seed=1).optim == LORA.updated(warmup_steps=3)
    assert partial.replace(init_from=None).optim == DEMO.updated(warmup_steps=3)
    assert TrainConfig().replace(init_from="base").optim == FINETUNE
    assert TrainConfig().optim == DEMO and TrainConfig().optim_default == "demo"  # from scratch: as before


def test_a_named_preset_lr_or_recipe_wins_as_before(tmp_path):
    assert TrainConfig(init_from="base", optim={"lr": 1e-3}).optim == DEMO.updated(lr=1e-3)
    assert TrainConfig(init_from="base", optim={"preset": "demo"}).optim == DEMO
    own = OptimConfig(name="adamw", lr=2e-4)
    assert TrainConfig(init_from="base", optim=own).with_optim_for(lora=True).optim == own
    for cfg in (TrainConfig(init_from="base", optim={"lr": 1e-3}), TrainConfig(init_from="base", optim=own)):
        assert cfg.optim_default is None and cfg.with_optim_for(lora=True) is cfg
    (tmp_path / "run.yaml").write_text("optim: {preset: demo, warmup_steps: 7}\n")

    def parse(flags):
        return build_parser("train").parse_args(["train", *flags])

    assert config_from_args(parse(["--init-from", "base", "--config", str(tmp_path / "run.yaml")])).optim == \
        DEMO.updated(warmup_steps=7)
    assert config_from_args(parse(["--init-from", "base", "--lr", "1e-4"])).optim == DEMO.updated(lr=1e-4)
    assert config_from_args(parse(["--init-from", "base", "--optim-preset", "demo"])).optim == DEMO
    assert config_from_args(parse(["--init-from", "base", "--warmup-steps", "4"])).optim == \
        FINETUNE.updated(warmup_steps=4)


def test_lora_runs_get_the_lora_preset_and_print_config_shows_the_choice(root, capsys):
    cfg = TrainConfig(init_from=str(root / "model"), data=str(root / "corpus"))
    assert resolved_config(cfg, lora=True).optim == LORA
    assert resolved_config(resolved_config(cfg, lora=True)).optim == LORA  # (applying it again changes nothing)
    args = build_parser("train").parse_args(["train", "--init-from", str(root / "model"), "--lora", "--print-config"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["optim"]["lr"] == LORA.lr


def test_the_run_says_which_preset_it_chose_and_a_run_started_on_the_old_default_resumes(root, tmp_path):
    def run(optim, log=None, out="run", **extra):
        values = {"max_steps": 2, **extra}
        cfg = tiny_train_config(root, tmp_path / out, init_from=str(root / "model"), tokenizer=None, save_every=1,
                                eval_batches=1, **values)
        if optim is None:  # (tiny_train_config names a recipe: this run names none)
            cfg = TrainConfig(**{**cfg.to_dict(), "optim": {}})
        else:
            cfg = cfg.replace(optim=optim)
        with OneThread():
            trainer = Trainer(cfg, log=log)
            trainer.run()
        trainer.close()
        return trainer

    lines: list[str] = []
    fresh = run(None, lines.append, out="fresh")
    assert fresh.cfg.optim == FINETUNE and fresh.optimizer.param_groups[0]["initial_lr"] == FINETUNE.lr
    assert "optimizer: the finetune preset (ellis-adam, lr 1e-05): the run names no optimizer preset or learning " \
           "rate (--optim-preset, --lr)" in lines
    # a run whose checkpoints record the demo recipe (what it was given before these presets) resumes with it
    run(DEMO)
    lines.clear()
    resumed = run(None, lines.append, resume=True, max_steps=3)
    assert resumed.state.step == 3 and resumed.cfg.optim == DEMO and not any(x.startswith("optimizer:") for x in lines)
    changed = TrainConfig(**{**resumed.cfg.to_dict(), "optim": {"warmup_steps": 4}, "max_steps": 4})
    with pytest.raises(ValueError, match=r"optim\.warmup_steps: 50 -> 4"):  # (a setting it names still counts)
        Trainer(changed)
