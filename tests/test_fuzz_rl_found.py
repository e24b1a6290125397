"""What a seeded fuzzer over `rdepth rl` settings, prompts and SFT records found: rollouts at depth 0, stop texts,
prompts longer than the context, a retrofitted model's tokenizer, and a lone surrogate in an SFT record."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, conversation
from recurrent_depth.evaluation.reasoning.data import ProblemEncoder, byte_tokenizer
from recurrent_depth.train.rl import ListPrompts, RolloutSettings, RolloutSource, ShapedReward, policy_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def byte_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))


def length(prompt: str, completion: str, depths: list[int]) -> float:
    return float(len(completion))


def rollouts(model, prompts: list[str], **generation) -> RolloutSource:
    settings = RolloutSettings(group_size=4, generation={"max_new_tokens": 6, "do_sample": True, "num_steps": 2,
                                                         **generation}, backprop_depth=1, seed=1)
    return RolloutSource(model, ListPrompts(prompts), ShapedReward(length, max_depth=2, max_new_tokens=6), settings,
                         encoder=ProblemEncoder(byte_tokenizer()))


@pytest.mark.parametrize("generation", [{"num_steps": 0},
                                        {"num_steps": 0, "max_steps": 4, "exit_criterion": "kl",
                                         "exit_threshold": 1e-2}])
def test_rollouts_at_depth_zero_are_refused_in_one_line(byte_model, generation):
    """--num-steps 0 ended every run in a ZeroDivisionError traceback (the compute penalty's max depth 0), and its
    positions at depth 0 were replayed at depth 1, so pi_theta != pi_old at the first update (a clip fraction of 1)."""
    settings = RolloutSettings(generation={"max_new_tokens": 2, "do_sample": True, **generation})
    with pytest.raises(ValueError, match=r"rollouts need num_steps >= 1 \(--num-steps\)"):
        settings.options(byte_model)
    with pytest.raises(ValueError, match="max_depth=0 is invalid"):
        ShapedReward(length, max_depth=0, max_new_tokens=2)


def test_stop_texts_stop_rollouts_and_replay_exactly(byte_model):
    """`rdepth rl --stop TEXT` (a flag it lists) was refused at the first rollout: "stop strings need a tokenizer:
    pass tokenizer=... to generate", which a CLI user cannot do."""
    source = rollouts(byte_model, ["hello there"], stop=["e", "t", " "], temperature=1.0, top_k=4)
    batch = source.next_batch(1)
    stopped = ~batch["truncated"]
    assert stopped.any()  # (seeded: some rollouts end at a stop text before max_new_tokens)
    logp = policy_logprobs(byte_model, batch, source.settings)
    mask = batch["completion_mask"]
    torch.testing.assert_close(logp[mask], batch["old_logp"][mask], rtol=0, atol=1e-5)


def test_a_prompt_longer_than_the_context_is_named_before_the_run(byte_model):
    """A --prompts line too long for max_seq_len was an error only when it was drawn (any update, maybe hours in),
    in a line naming no prompt."""
    with pytest.raises(ValueError, match=r"prompt 2 \('yyyy.*is 301 tokens: with max_new_tokens=6 it exceeds the "
                                         r"model's max_seq_len=256"):
        rollouts(byte_model, ["short", "y" * 300])
    rollouts(byte_model, ["short", "y" * 249])  # 250 tokens with <|begin_text|> + 6 new: fits


def test_rollouts_use_a_retrofitted_tokenizer_s_own_document_tokens():
    """The encoder took the ids at our tokenizer layout's positions (vocab - 32 + i) from any tokenizer: with a
    retrofitted model's (<s> / </s>) every prompt began with an ordinary token and rollouts stopped at another."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog 0123456789 " * 20], trainer)
    encoder = ProblemEncoder(tokenizer)
    assert [tokenizer.id_to_token(i) for i in (encoder.bos, encoder.eos, encoder.pad)] == ["<s>", "</s>", "</s>"]
    ours = ProblemEncoder(byte_tokenizer())  # (ours: the named special tokens, as before)
    assert (ours.bos, ours.eos, ours.pad) == (256, 257, 261)


def test_a_lone_surrogate_in_an_sft_record_is_one_line(tmp_path):
    """JSON allows "\\ud800"; such a record reached the tokenizer and `rdepth sft` ended in a TypeError traceback."""
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = rd.ModelConfig.from_preset("tiny", vocab_size=288, bos_token_id=256, eos_token_id=257)
    encoder = ExampleEncoder(tmp_path, config)
    record = {"prompt": "hi", "completion": "ok \ud800"}
    with pytest.raises(ValueError, match=r"^data.jsonl:3: the record holds text that is not valid Unicode"):
        encoder.encode(conversation(record, "data.jsonl:3"), "data.jsonl:3")
    assert encoder.encode(conversation({"prompt": "hi", "completion": "ok"}, "w"), "w").ids[-1] == 257


def test_an_ignored_rollout_option_warns_once(byte_model):
    """build_rl validated the rollout options and RolloutSource validated them again: every warning twice."""
    import warnings

    from recurrent_depth.inference.options import OptionWarning
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.rl.recipe import RLConfig, build_rl
    from tests.test_rl import ROLLOUT

    rl = RLConfig(task="shells", difficulties=[2], reward="tests.test_rl:char_sum", group_size=2,
                  generation={**ROLLOUT, "headway": 2})  # (headway outside the parallel sampler: ignored)
    train = TrainConfig(out=None, max_steps=1, batch_size=1, progress=False, tensorboard=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_rl(byte_model, rl, train, log=lambda line: None)
    said = [str(w.message) for w in caught if issubclass(w.category, OptionWarning)]
    assert len(said) == 1 and "headway" in said[0], said
