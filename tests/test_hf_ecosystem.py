"""The transformers wrapper used the way ML engineers use any causal LM: Trainer hooks, peft, save/load arguments."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurrent_depth.model.recurrent as recurrent
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-eco")
    make_model_dir(path, with_tokenizer=False)
    return path


def test_trainers_activation_checkpointing_call_works_and_checkpoints_the_core(model_dir, monkeypatch):
    """transformers 5's Trainer calls `activation_checkpointing_enable(..., every_n_layers=, offload=)`; a training
    forward with the default `use_cache` must then checkpoint the core steps (a cache turns checkpointing off)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    assert model.is_activation_checkpointing
    calls = []
    real = recurrent.checkpoint
    monkeypatch.setattr(recurrent, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    x = ids(length=8)
    out = model(input_ids=x, labels=x, num_steps=(1, 2), init_scale=0.0)
    out.loss.backward()
    assert len(calls) == 2 and out.cache is None
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing


def test_resize_token_embeddings_lets_the_new_ids_through(model_dir, tmp_path):
    """`tokenizer.add_tokens(...)` + `model.resize_token_embeddings(len(tokenizer))`: the new ids must be accepted."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    old = model.config.vocab_size
    model.resize_token_embeddings(old + 4)
    x = torch.tensor([[1, 2, old + 3]])
    with torch.no_grad():
        logits = model(x, num_steps=2).logits
    assert logits.shape[-1] == old + 4 and model.lm_head.weight is model.transformer.wte.weight
    assert model.generate(x, max_new_tokens=2, num_steps=2, do_sample=False).shape == (1, 5)
    assert model.generate(x, max_new_tokens=2, exit_criterion="kl").shape == (1, 5)  # routed to rd.generate
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, init_scale=0.0).eval()
    with torch.no_grad():
        assert torch.equal(again(x, num_steps=2).logits, logits)


def test_resize_token_embeddings_refuses_value_embeddings_in_one_line(tmp_path):
    make_model_dir(tmp_path, with_tokenizer=False, value_embeddings=[0])
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="value embeddings"):
        model.resize_token_embeddings(model.config.vocab_size + 4)


def test_remote_code_file_honours_the_trainers_loss_count_hidden_states_and_refuses_embeds(model_dir, tmp_path):
    """The exported file's forward takes **kwargs, so the Trainer passes `num_items_in_batch` and then does not divide
    the loss by the accumulation steps: ignoring it made gradient accumulation scale the gradients up. It also
    ignored `output_hidden_states` / `return_dict`, and `inputs_embeds` was an AttributeError."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = ids(length=8)
    labels = x.clone()
    labels[0, :5] = -100
    count = int((labels[:, 1:] != -100).sum())
    kw = dict(num_steps=2, init_scale=0.0)
    with torch.no_grad():
        mean = exported(x, labels=labels, **kw).loss
        summed = exported(x, labels=labels, num_items_in_batch=count * 2, **kw).loss
        torch.testing.assert_close(summed, mean / 2)
        torch.testing.assert_close(summed, ours(x, labels=labels, num_items_in_batch=count * 2, **kw).loss)
        states = exported(x, output_hidden_states=True, **kw).hidden_states
        expected = ours(x, output_hidden_states=True, **kw).hidden_states
        assert len(states) == len(expected) == 3
        for a, b in zip(states, expected):
            torch.testing.assert_close(a, b)
        as_tuple = exported(x, return_dict=False, use_cache=False, **kw)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], exported(x, **kw).logits)
    with pytest.raises(ValueError, match="^inputs_embeds is not supported"):
        exported(inputs_embeds=torch.zeros(1, 3, exported.config.hidden_size))


def test_prompt_lookup_and_assisted_decoding_equal_greedy(model_dir):
    """transformers' assisted decoding needs the cache before the first forward: it raised 'Assisted decoding
    requires a cache' because forward() creates ours lazily."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = dict(max_new_tokens=6, do_sample=False, num_steps=2)
    greedy = model.generate(x, **kw)
    assert torch.equal(model.generate(x, prompt_lookup_num_tokens=3, **kw), greedy)
    assert torch.equal(model.generate(x, assistant_model=model, **kw), greedy)


def test_chunked_prefill_equals_greedy_in_ours_and_the_remote_code_file(model_dir, tmp_path):
    """`generate(prefill_chunk_size=N)` raised transformers' 'Cannot use prefill chunking without a cache': the
    cache is created by forward(), after transformers checked for it."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", init_scale=0.0).eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = ids(batch=2, length=7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    kw = dict(max_new_tokens=4, do_sample=False, num_steps=2, attention_mask=mask)
    for model in (ours, exported):
        assert torch.equal(model.generate(x, prefill_chunk_size=3, **kw), model.generate(x, **kw))


def test_remote_code_file_runs_prompt_lookup_decoding(model_dir, tmp_path):
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = dict(max_new_tokens=6, do_sample=False, num_steps=2, init_scale=0.0)
    assert torch.equal(exported.generate(x, prompt_lookup_num_tokens=3, **kw), exported.generate(x, **kw))


def test_our_options_in_generation_config_json_are_defaults_and_keywords_still_win(model_dir, tmp_path):
    """transformers carries custom entries of the model's generation config into every call's config, where an entry
    named like a keyword swallows it: a generation_config.json holding num_steps made `generate(num_steps=...)` run
    at config.mean_recurrence, and the file's own value was not used either."""
    from transformers import GenerationConfig

    make_model_dir(tmp_path, with_tokenizer=False)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, init_scale=0.0).eval()
    GenerationConfig(num_steps=1, exit_criterion=None).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, init_scale=0.0).eval()
    x = ids(batch=1, length=6)
    kw = dict(max_new_tokens=4, do_sample=False)
    depth = {n: plain.generate(x, num_steps=n, **kw) for n in (1, 2, 4)}
    assert not torch.equal(depth[1], depth[2]) and not torch.equal(depth[2], depth[4])
    assert torch.equal(model.generate(x, **kw), depth[1])
    assert torch.equal(model.generate(x, num_steps=2, **kw), depth[2])
    model.generation_config.exit_criterion = "kl"  # a routed option set on the model's config routes the call
    assert type(model.generate(x, return_dict_in_generate=True, **kw)).__name__ == "GenerationOutput"


def test_our_options_set_on_the_models_generation_config_survive_save_pretrained(model_dir, tmp_path):
    """The generation config transformers derives from config.json is marked `_from_model_config`, and transformers
    reads such a file back without its custom entries: `num_steps` set on it and saved was silently dropped."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = ids(batch=1, length=6)
    kw = dict(max_new_tokens=3, do_sample=False)
    expected = model.generate(x, num_steps=1, **kw)
    assert not torch.equal(expected, model.generate(x, **kw))
    model.generation_config.num_steps = 1
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.generation_config.num_steps == 1
    assert torch.equal(again.generate(x, **kw), expected)


def test_remote_code_files_generation_config_options_survive_save_pretrained(model_dir, tmp_path):
    """The exported file's model lost `generation_config.num_steps` on save and reload, as ours did."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", init_scale=0.0).eval()
    x = ids(batch=1, length=6)
    kw = dict(max_new_tokens=3, do_sample=False)
    expected = exported.generate(x, num_steps=1, **kw)
    exported.generation_config.num_steps = 1
    exported.save_pretrained(tmp_path / "saved")
    again = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(again.generate(x, **kw), expected)


def test_trainer_label_smoothing_shifts_the_labels(model_dir, tmp_path):
    """The Trainer shifts labels for its label smoother only for causal LMs it knows by class name; ours was not
    among them, so `label_smoothing_factor` trained each position on its own token instead of the next one."""
    from transformers import Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0, mean_recurrence=2).eval()
    x = ids(length=8)
    with torch.no_grad():
        expected = model(input_ids=x, labels=x).loss
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=1e-6)
    with torch.no_grad():
        smoothed = Trainer(model=model, args=args).compute_loss(model, {"input_ids": x, "labels": x})
    torch.testing.assert_close(smoothed, expected, atol=1e-4, rtol=0)


def test_the_remote_code_file_names_its_class_for_the_trainers_label_shift(monkeypatch):
    """The same table, filled by the exported file itself (a process without the library)."""
    import importlib

    from transformers.models.auto import modeling_auto

    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    names = dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    names.pop("recurrent_depth", None)
    monkeypatch.setattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", names)
    importlib.reload(remote)
    assert names["recurrent_depth"] == remote.RecurrentDepthForCausalLM.__name__


def test_attn_implementation_sdpa_is_accepted(model_dir, tmp_path):
    """Attention always runs through scaled_dot_product_attention, yet attn_implementation="sdpa" (what training
    scripts pass) was refused as unsupported, by the library's class and by the remote-code file."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa")
    assert exported.config._attn_implementation == "sdpa"


def test_an_adapter_made_with_peft_on_the_transformers_class_loads_in_the_library(model_dir, tmp_path):
    """peft's usual `LoraConfig(task_type="CAUSAL_LM")` adapter: `rdepth generate --lora` (load_lora on a
    RecurrentDepthLM) failed with an AttributeError traceback (no prepare_inputs_for_generation)."""
    peft = pytest.importorskip("peft")
    import recurrent_depth as rd
    from recurrent_depth.train.lora import load_lora

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    tuned = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["Wqkv", "proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    tuned.save_pretrained(tmp_path)
    x = ids(length=6)
    library = load_lora(rd.RecurrentDepthLM.from_pretrained(model_dir), tmp_path).get_base_model().eval()
    with torch.no_grad():
        expected = tuned.eval()(input_ids=x, num_steps=2, init_scale=0.0).logits
        assert torch.equal(library(x, num_steps=2, init_scale=0.0).logits, expected)


def test_remote_code_file_takes_its_options_from_a_generation_config(model_dir, tmp_path):
    """`generate(ids, GenerationConfig(num_steps=1))`, the model card's way, ran the exported file at
    config.mean_recurrence, and a library-only option set there (criterion) was silently ignored."""
    from transformers import GenerationConfig

    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", init_scale=0.0).eval()
    x = ids(batch=1, length=6)
    kw = dict(max_new_tokens=4, do_sample=False)
    shallow, deep = exported.generate(x, num_steps=1, **kw), exported.generate(x, num_steps=4, **kw)
    assert not torch.equal(shallow, deep)
    assert torch.equal(exported.generate(x, GenerationConfig(num_steps=1, **kw)), shallow)
    assert torch.equal(exported.generate(x, GenerationConfig(num_steps=1, **kw), num_steps=4), deep)
    with pytest.raises(ValueError, match="^criterion: this exported model"):
        exported.generate(x, GenerationConfig(criterion="kl", **kw))


def test_resize_token_embeddings_of_an_official_huginn_directory_saves_a_loadable_config(tmp_path):
    """Huginn's config sizes the embedding by padded_vocab_size, which the resize left at the old size: the saved
    directory then failed to load (config vocabulary against the stored embedding)."""
    import recurrent_depth as rd
    from tests.test_checkpoint import write_official_layout
    from tests.test_hf import tiny_config

    write_official_layout(rd.RecurrentDepthLM(tiny_config()), tmp_path / "official", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "official", init_scale=0.0).eval()
    new = model.config.vocab_size + 4
    model.resize_token_embeddings(new)
    model.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized", init_scale=0.0).eval()
    x = torch.tensor([[1, 2, new - 1]])
    with torch.no_grad():
        assert torch.equal(again(x, num_steps=2).logits, model(x, num_steps=2).logits)
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "resized").config.vocab_size == new


def test_trainer_predictions_are_the_logits(model_dir, tmp_path):
    """The Trainer's predictions (what compute_metrics gets) held (logits, latent_states, final_state), so the usual
    `eval_pred.predictions.argmax(-1)` failed: the extras are keys the Trainer leaves out at inference."""
    from transformers import Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0, mean_recurrence=2).eval()
    x = ids(length=8)
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    loss, logits, labels = Trainer(model=model, args=args).prediction_step(model, {"input_ids": x, "labels": x}, False)
    assert isinstance(logits, torch.Tensor) and logits.shape == (*x.shape, model.config.vocab_size)


def test_continuing_a_cache_refuses_what_it_cannot_continue_and_stays_usable(model_dir, tmp_path):
    """Multi-turn generation with the returned cache: a prompt no longer than the cache was fed again after it
    (silently wrong logits) or left empty; a deeper num_steps, or another batch size, failed deep inside (torch.cat,
    a message about per-token exit) after the prelude had already written to the cache, which was then unusable."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", init_scale=0.0).eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = ids(batch=1, length=5)
    kw = dict(max_new_tokens=3, do_sample=False, num_steps=2)
    for model in (ours, exported):
        out = model.generate(x, return_dict_in_generate=True, **kw)
        cache = out.past_key_values
        assert cache.get_seq_length() == 7
        turn = torch.cat([out.sequences, ids(batch=1, length=2, seed=1)], dim=1)
        for prompt in (out.sequences[:, :-1], x):
            message = rf"^generate: the cache holds 7 tokens but input_ids has {prompt.shape[1]}:"
            with pytest.raises(ValueError, match=message):
                model.generate(prompt, cache=cache, **kw)
        with pytest.raises(ValueError, match="^the cache holds 7 tokens computed with .*at the num_steps that filled"):
            model.generate(turn, cache=cache, **{**kw, "num_steps": 3})
        with pytest.raises(ValueError, match="^the cache holds 1 rows but this call has 2"):
            model.generate(turn.repeat(2, 1), cache=cache, **kw)
        assert torch.equal(model.generate(turn, cache=cache, **kw), model.generate(turn, **kw))


def test_a_routed_call_takes_the_models_generation_config_as_transformers_loop_does(model_dir):
    """generation_config.json's sampling settings and eos ids are the base of transformers' loop; a call routed to
    recurrent_depth.generate (exit_criterion, ...) dropped them: greedy decoding, past the config's eos ids."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = ids(batch=1, length=6)
    routed = dict(max_new_tokens=6, num_steps=2, exit_criterion="kl", exit_threshold=0.0)
    greedy = model.generate(x, do_sample=False, **routed)
    model.generation_config.eos_token_id = [model.config.eos_token_id, int(greedy[0, 8])]
    assert torch.equal(model.generate(x, **routed), greedy[:, :9])
    assert torch.equal(model.generate(x, num_steps=2, max_new_tokens=6), greedy[:, :9])  # transformers' loop
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.do_sample, model.generation_config.temperature = True, 50.0
    torch.manual_seed(0)
    assert not torch.equal(model.generate(x, **routed), greedy)
    assert torch.equal(model.generate(x, do_sample=False, **routed), greedy)  # the call's keyword wins


def test_generate_past_max_seq_len_is_refused_before_it_starts(model_dir, tmp_path):
    """transformers' loop ran up to max_seq_len and then raised at the next token, the tokens generated until then
    lost; the library refuses such a call before it starts, and so do ours and the exported file now."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out", init_scale=0.0).eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    limit = ours.config.max_position_embeddings
    x = ids(batch=1, length=limit - 2)
    for model in (ours, exported):
        for too_long in (dict(max_new_tokens=4), dict(max_length=limit + 2), dict(max_new_tokens=4, num_beams=2)):
            with pytest.raises(ValueError, match=rf"^generate: prompt length {limit - 2} \+ 4 new tokens .* "
                                                 rf"max_seq_len={limit}$"):
                model.generate(x, num_steps=1, do_sample=False, **too_long)
        # the last token is sampled, never fed: max_seq_len + 1 tokens in all fit
        assert model.generate(x, num_steps=1, do_sample=False, max_new_tokens=3).shape[1] == limit + 1


def test_remote_code_file_honours_position_ids_and_generator_and_refuses_unknown_arguments(model_dir, tmp_path):
    """The exported file's forward takes **kwargs and read only some of them: `position_ids` (which ours honours),
    `generator` (ours draws s_0 from it) and a misspelt option (`num_step=`) changed nothing, without a word."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = ids(batch=2, length=7)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    positions = torch.tensor([[1, 1, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        for kw in (dict(position_ids=positions), dict(position_ids=positions, attention_mask=mask),
                   dict(position_ids=positions[1:])):
            shifted = exported(x, num_steps=2, init_scale=0.0, **kw).logits
            torch.testing.assert_close(shifted, ours(x, num_steps=2, init_scale=0.0, **kw).logits)
        assert not torch.allclose(shifted, exported(x, num_steps=2, init_scale=0.0).logits)
        drawn = exported(x, num_steps=2, generator=torch.Generator().manual_seed(3)).logits
        torch.testing.assert_close(drawn, ours(x, num_steps=2, generator=torch.Generator().manual_seed(3)).logits)
        with pytest.raises(ValueError, match=r"^unexpected forward\(\) arguments \['num_step'\]"):
            exported(x, num_step=2)
        with pytest.raises(ValueError, match=r"^position_ids must be integer positions in \[0, max_seq_len="):
            exported(x, num_steps=2, position_ids=positions + 200)
        with pytest.raises(ValueError, match=r"^input_states must have shape .* = \(2, 7, 64\), got \(2, 3, 64\)$"):
            exported(x, num_steps=2, input_states=torch.zeros(2, 3, 64))


def test_logits_to_keep_keeps_those_logits_in_ours_and_the_remote_code_file(model_dir, tmp_path):
    """transformers' `model(ids, logits_to_keep=1).logits` is `[B, 1, V]`; both forwards dropped the argument and
    returned every position's logits."""
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    assert main(["export", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = ids(batch=2, length=7)
    kw = dict(num_steps=2, init_scale=0.0, labels=x)
    with torch.no_grad():
        for model in (ours, exported):
            full = model(x, **kw)
            last = model(x, logits_to_keep=1, **kw)
            assert last.logits.shape == (2, 1, full.logits.shape[-1])
            torch.testing.assert_close(last.logits, full.logits[:, -1:])
            torch.testing.assert_close(last.loss, full.loss)  # the loss still reads every position
            picked = model(x, logits_to_keep=torch.tensor([0, 4]), **kw).logits
            torch.testing.assert_close(picked, full.logits[:, [0, 4]])
            assert torch.equal(model(x, logits_to_keep=0, **kw).logits, full.logits)
            with pytest.raises(ValueError, match=r"^logits_to_keep=-1 is invalid: expected an integer >= 0"):
                model(x, logits_to_keep=-1, **kw)


def test_rdepth_generate_reads_the_generation_config_json_our_transformers_classes_read(tmp_path, capsys):
    """num_steps, init_scale, max_new_tokens and eos_token_id set on `model.generation_config` and saved: transformers'
    generate ran with them, `rdepth generate` on the same directory ignored the file (its own 64 tokens at
    mean_recurrence, past the eos). Flags still win; --generation-config none ignores the file."""
    import json

    from tokenizers import Tokenizer

    from recurrent_depth.cli import main

    make_model_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.tensor([Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("a=1;").ids])
    first = model.generate(x, num_steps=1, init_scale=0.0, max_new_tokens=8, do_sample=False)[0, x.shape[1]:]
    stop = int(first[5])  # an eos id from the file ends the row there (the first time the token comes up)
    model.generation_config.num_steps, model.generation_config.init_scale = 1, 0.0
    model.generation_config.update(max_new_tokens=8, eos_token_id=[stop])
    model.save_pretrained(tmp_path)
    want = AutoModelForCausalLM.from_pretrained(tmp_path).eval().generate(x)[0, x.shape[1]:].tolist()
    assert len(want) < 8 and want[-1] == stop

    def cli(*flags: str) -> dict:
        assert main(["generate", "--model", str(tmp_path), "--prompt", "a=1;", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    record = cli()
    assert record["tokens"] == [want] and record["steps"] == [[1] * len(want)]
    deeper = cli("--num-steps", "2", "--max-new-tokens", "3")  # the flags win over the file
    assert deeper["steps"] == [[2, 2, 2]]
    plain = cli("--generation-config", "none", "--max-new-tokens", "12")  # the model config's depth and eos
    assert plain["steps"][0][1:] == [model.config.mean_recurrence] * (len(plain["steps"][0]) - 1)

    # --exit-threshold auto: the official threshold of the file's exit_criterion, kl's 1e-3 (it exited 2, "needs an
    # exit_criterion": resolved before the file was read)
    (tmp_path / "generation_config.json").write_text(json.dumps({"exit_criterion": "kl", "init_scale": 0.0}))
    auto = cli("--exit-threshold", "auto", "--max-new-tokens", "3", "--num-steps", "6")
    explicit = cli("--exit-threshold", "0.001", "--max-new-tokens", "3", "--num-steps", "6")
    assert (auto["tokens"], auto["steps"]) == (explicit["tokens"], explicit["steps"])


def test_generation_config_json_defaults_follow_transformers_rules_and_reach_rdepth_serve(tmp_path, capsys):
    """What the file sets, by our names (official aliases resolved, stop_strings as stop); its temperature / top_k
    only where the call samples (do_sample decides, as in transformers); entries nothing here runs named on stderr;
    a value of the wrong type a one-line error naming the file. `rdepth serve` takes its num_steps and kv_quant
    where the flags are not given (it ignored the file)."""
    import argparse
    import json

    from recurrent_depth.cli.serve import apply_generation_defaults
    from recurrent_depth.generation_config import generation_defaults, with_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.5, "top_k": 5, "criterion": "kl", "stop_strings": "\n\n", "num_steps": 3,
        "kv_quant": "k=prod:3.5,v=mse:3.5", "num_beams": 4, "max_length": 50, "bos_token_id": 1,
        "transformers_version": "5.0.0"}))
    defaults = generation_defaults(str(tmp_path), "auto", "rdepth generate")
    assert defaults == {"do_sample": True, "temperature": 0.5, "top_k": 5, "exit_criterion": "kl", "stop": ["\n\n"],
                        "num_steps": 3, "kv_quant": "k=prod:3.5,v=mse:3.5", "eos_token_id": []}  # (none in the file)
    assert "sets ['max_length', 'num_beams'], which rdepth generate does not run" in capsys.readouterr().err
    assert generation_defaults(str(tmp_path), "none", "rdepth generate") == {}
    greedy = with_generation_defaults({"do_sample": False, "num_steps": 2}, defaults)
    assert greedy == {"do_sample": False, "num_steps": 2, "exit_criterion": "kl", "stop": ["\n\n"],
                      "kv_quant": "k=prod:3.5,v=mse:3.5", "eos_token_id": []}  # no temperature / top_k: greedy
    assert with_generation_defaults({"top_p": 0.9, "do_sample": True}, defaults)["temperature"] == 0.5

    args = argparse.Namespace(model=str(tmp_path), generation_config="auto", num_steps=None, kv_quant=None,
                              max_depth=None)
    rest = apply_generation_defaults(args)  # the rest: the defaults of the fields a request leaves out
    assert (args.num_steps, args.kv_quant) == (3, "k=prod:3.5,v=mse:3.5")
    assert rest == {"do_sample": True, "temperature": 0.5, "top_k": 5, "exit_criterion": "kl", "stop": ["\n\n"],
                    "eos_token_id": []}
    args = argparse.Namespace(model=str(tmp_path), generation_config="auto", num_steps=7, kv_quant=None,
                              max_depth=None)
    apply_generation_defaults(args)
    assert args.num_steps == 7  # the flag wins

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature='hot' is invalid: expected None or a "
                                         r"number \(--generation-config none ignores the file\)$"):
        generation_defaults(str(tmp_path), "auto", "rdepth generate")
    (tmp_path / "generation_config.json").write_text(json.dumps({"num_steps": 9}))  # the file obeys --max-depth too
    with pytest.raises(ValueError, match=r"generation_config.json: num_steps=9 is invalid: expected an integer in "
                                         r"\[0, 8\]"):
        generation_defaults(str(tmp_path), "auto", "rdepth generate", max_depth=8)
