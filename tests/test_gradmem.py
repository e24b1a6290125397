"""GradMem (inference/gradmem.py): memory tokens written by test-time gradient steps, generation
reading them instead of the context.

References: with 0 steps and the "tail" init the memory is the embeddings of the context's last m
tokens, so generation must give exactly the tokens of plain generation on [those tokens; query];
the write loss equals the model's own labelled loss on [tail; context]; a row in a batch gets the
memory it gets alone; the cost equals the library's FLOP counter for the passes that ran.
"""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.inference import Stopped, generate, generate_from_memory
from recurrent_depth.inference.gradmem import memory_loss, memory_prompt, write_memory
from recurrent_depth.inference.options import OptionError
from recurrent_depth.train.flops import training_step_flops

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def ids(seed: int, n: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, width - len(r) :] = r
        mask[b, width - len(r) :] = 1
    return out, mask


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
def test_zero_steps_equal_plain_generation_on_the_initial_memory(model, fast):
    """Rows of different lengths (left padding), sampling from seeds: the context is dropped, the
    initial memory (its last m tokens' embeddings) stands before the query."""
    m, q = 3, 2
    contexts, queries = [ids(1, 9), ids(2, 5)], [ids(3, q), ids(4, q)]
    prompt, mask = left_padded([torch.cat([c, k]) for c, k in zip(contexts, queries)])
    common = dict(max_new_tokens=6, num_steps=3, do_sample=True, seed=11, fast=fast, output_logits=True)
    out = generate(model, prompt, attention_mask=mask, gradmem_tokens=m, gradmem_steps=0, gradmem_query_tokens=q,
                   **common)
    plain_prompt, plain_mask = left_padded([torch.cat([c[-m:], k]) for c, k in zip(contexts, queries)])
    plain = generate(model, plain_prompt, attention_mask=plain_mask, **common)
    assert out.token_lists() == plain.token_lists()
    assert torch.equal(out.logits, plain.logits)  # (a random tiny model's tokens hardly depend on the prompt)
    assert torch.equal(out.steps, plain.steps)
    assert torch.equal(out.sequences[:, : prompt.shape[1]], prompt)  # the caller's prompt, then the new tokens
    assert out.stats["gradmem_flops"] == 0 and out.stats["gradmem_losses"] == []


@pytest.mark.parametrize("mode", [dict(draft_steps=1, lookahead=3), dict(sampler="parallel", inner_steps=2),
                                  dict(exit_criterion="kl", exit_threshold=1e-3, exit_in_prefill=True)],
                         ids=["speculative", "parallel", "exit-in-prefill"])
def test_every_decoding_mode_reads_the_memory_prompt(model, mode):
    context, query = ids(14, 10), ids(15, 2)
    common = dict(max_new_tokens=5, num_steps=3, init_scale=0, output_logits=True, **mode)
    out = generate(model, torch.cat([context, query]), gradmem_tokens=3, gradmem_steps=0, gradmem_query_tokens=2,
                   **common)
    plain = generate(model, torch.cat([context[-3:], query]), **common)
    assert out.token_lists() == plain.token_lists() and torch.equal(out.steps, plain.steps)
    assert torch.equal(out.logits, plain.logits)


def test_one_written_memory_answers_several_queries(model):
    """generate_from_memory reads a memory written once; each query's answer equals the one-call
    generate that writes the same memory (a deterministic write: s_0 = 0) and reads that query."""
    context, queries = ids(16, 12), [ids(17, 3), ids(18, 2)]
    common = dict(max_new_tokens=4, num_steps=2, init_scale=0, output_logits=True)
    w = write_memory(model, context, tokens=3, steps=2, lr=1.0, depth=2, init_scale=0)
    query, mask = left_padded(queries)
    out = generate_from_memory(model, w.memory, query, attention_mask=mask, **common)
    for b, q in enumerate(queries):
        one = generate(model, torch.cat([context, q]), gradmem_tokens=3, gradmem_steps=2, gradmem_depth=2,
                       gradmem_query_tokens=len(q), **common)
        assert out.token_lists()[b] == one.token_lists()[0]
        # a padded batch and one row round differently (measured 1.2e-6 on an AVX2 CPU)
        torch.testing.assert_close(out.logits[b], one.logits[0], rtol=0, atol=1e-5)
    alone = generate_from_memory(model, w.memory[0], None, **common)  # no query: continue from the memory
    assert alone.sequences.shape[1] == 3 + 4
    with pytest.raises(OptionError, match="a memory was given to read: leave gradmem_tokens at 0"):
        generate_from_memory(model, w.memory, query, attention_mask=mask, gradmem_tokens=2)
    with pytest.raises(ValueError, match=r"memory must have shape \[B, m >= 1, hidden_size=64\]"):
        generate_from_memory(model, torch.zeros(1, 2, 5), query)


def test_random_init_is_the_seeded_draw_at_the_embedding_scale(model):
    w = write_memory(model, ids(5, 6), tokens=4, steps=0, lr=1.0, init="random", seed=7)
    g = torch.Generator().manual_seed(7)
    std = float(model.transformer.wte.weight.detach().std())
    expected = torch.randn(4, model.config.hidden_size, generator=g) * std
    assert torch.equal(w.memory[0], expected)


def test_the_write_loss_is_the_models_labelled_loss_on_memory_and_context(model):
    """memory_loss of the tail's embeddings = the forward's own loss on [tail; context] with the
    tail's labels ignored (s_0 = 0 on both sides)."""
    m, ctx = 4, ids(6, 10)
    tail = ctx[-m:]
    memory = model.transformer.wte.weight.detach()[tail][None]
    ours = memory_loss(model, memory, ctx[None], num_steps=3, init_scale=0)
    full = torch.cat([tail, ctx])[None]
    labels = torch.cat([torch.full((m,), -100), ctx])[None]
    theirs = model(full, num_steps=3, labels=labels, init_scale=0).loss
    torch.testing.assert_close(ours[0], theirs, rtol=1e-5, atol=1e-6)


def test_steps_lower_the_reconstruction_loss_and_leave_the_weights_bit_identical(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    model.train()
    ctx = ids(7, 24)
    w = write_memory(model, ctx, tokens=4, steps=6, lr=1.0, depth=2, init_scale=0)
    losses = [row[0] for row in w.losses]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    final = float(memory_loss(model, w.memory, ctx[None], num_steps=2, init_scale=0)[0].detach())
    assert final < losses[0]
    assert model.training  # the mode is restored
    model.eval()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None and p.requires_grad == flags[k] for k, p in model.named_parameters())


def test_one_step_is_sgd_on_the_memory(model):
    ctx, lr = ids(8, 12), 0.5
    start = write_memory(model, ctx, tokens=3, steps=0, lr=lr, init_scale=0).memory.requires_grad_(True)
    (grad,) = torch.autograd.grad(memory_loss(model, start, ctx[None], num_steps=2, init_scale=0).sum(), start)
    w = write_memory(model, ctx, tokens=3, steps=1, lr=lr, depth=2, init_scale=0)
    torch.testing.assert_close(w.memory, start.detach() - lr * grad)


def test_a_row_in_a_batch_gets_the_memory_it_gets_alone(model):
    rows = [ids(9, 14), ids(10, 8)]
    batch = torch.zeros(2, 14, dtype=torch.long)
    batch[0], batch[1, :8] = rows[0], rows[1]
    together = write_memory(model, batch, lengths=[14, 8], tokens=3, steps=2, lr=1.0, depth=2, seed=[5, 9])
    for b, row in enumerate(rows):
        alone = write_memory(model, row, tokens=3, steps=2, lr=1.0, depth=2, seed=[5, 9][b])
        torch.testing.assert_close(together.memory[b], alone.memory[0], rtol=1e-5, atol=1e-6)
        assert together.losses[0][b] == pytest.approx(alone.losses[0][0], rel=1e-5)


def test_the_cost_is_the_flop_counters_for_each_write_pass(model):
    ctx, m, steps, depth = ids(11, 17), 5, 3, 2
    out = generate(model, ctx, max_new_tokens=2, num_steps=4, gradmem_tokens=m, gradmem_steps=steps,
                   gradmem_depth=depth, seed=0)
    one = training_step_flops(model.config, 1, m + 17, (0, depth))
    assert out.stats["gradmem_flops"] == steps * (one.forward + one.backward)
    assert one.backward == 2 * one.forward  # every pass backpropagates through the whole model
    assert out.summary()["gradmem_flops"] == out.stats["gradmem_flops"]
    assert len(out.stats["gradmem_losses"]) == steps and out.stats["gradmem_depth"] == depth
    lin = rd.ModelConfig.from_preset("tiny", mixer="linear_attention")
    torch.manual_seed(0)
    w = write_memory(rd.RecurrentDepthLM(lin).eval(), ctx, tokens=2, steps=1, lr=1.0, depth=1)
    assert w.flops is None  # the counter counts softmax attention only


def test_memory_prompt_lays_out_memory_then_query_left_padded(model):
    memory = torch.randn(2, 3, model.config.hidden_size)
    query = torch.tensor([[7, 8], [9, 0]])
    ids_, mask, embedded, embeds = memory_prompt(model, memory, query, [2, 1])
    assert ids_[0, 3:].tolist() == [7, 8] and ids_[1, 4:].tolist() == [9]
    assert mask[1].tolist() == [False, True, True, True, True] and mask[0].all()
    assert embedded.tolist() == [[True] * 3 + [False] * 2, [False] + [True] * 3 + [False]]
    torch.testing.assert_close(embeds[1, 1:4], memory[1])
    torch.testing.assert_close(embeds[1, 4], model.transformer.wte.weight[9].detach())


def test_the_write_stops_between_steps(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    with pytest.raises(Stopped):
        write_memory(model, ids(12, 8), tokens=2, steps=5, lr=1.0, depth=1,
                     should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("kwargs,match", [
    (dict(gradmem_tokens=2, gradmem_lr=0.0), r"gradmem_lr=0.0 is invalid: expected a number in \(0, inf\)"),
    (dict(gradmem_tokens=2, gradmem_init="zeros"), "gradmem_init='zeros' is invalid: expected one of"),
    (dict(gradmem_tokens=-1), "gradmem_tokens=-1 is invalid: expected an integer >= 0"),
    (dict(gradmem_tokens=2, gradmem_query_tokens=6), "gradmem_query_tokens=6 leaves row 0 no context to write"),
    (dict(gradmem_tokens=7), "gradmem_init='tail' starts the memory from the context's last gradmem_tokens=7"),
    (dict(gradmem_tokens=254), "exceed the model's max_seq_len=256"),
    # a random s_0 at depth 0 never reads the memory (the write used to crash in autograd)
    (dict(gradmem_tokens=2, gradmem_depth=0), "gradmem_depth=0 is invalid: expected None or an integer >= 1"),
    (dict(gradmem_tokens=2, num_steps=0), "gradmem_depth defaults to num_steps=0, but a GradMem write needs depth"),
])
def test_bad_options_get_one_line_errors(model, kwargs, match):
    with pytest.raises(OptionError, match=match) as info:
        generate(model, ids(13, 6), max_new_tokens=1, **kwargs)
    assert "\n" not in str(info.value)


def test_a_diverging_learning_rate_is_a_one_line_error_not_a_nan_memory(model):
    """A write whose memory overflows would generate from NaN logits (argmax garbage, NaN stats): refused."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OptionError, match="gradmem_lr=1e\\+38 made the write diverge") as info:
        generate(model, ids(13, 12), max_new_tokens=1, seed=0, gradmem_tokens=2, gradmem_steps=4, gradmem_lr=1e38)
    assert "\n" not in str(info.value)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_bad_inputs_and_models_get_one_line_errors(model):
    with pytest.raises(ValueError, match=r"context_ids\[0, 1\]=999 is outside the vocabulary"):
        write_memory(model, [1, 999], tokens=1, steps=1, lr=1.0)
    with pytest.raises(ValueError, match=r"memory must have shape \[2, 64\]"):
        write_memory(model, [1, 2, 3], tokens=2, steps=1, lr=1.0, memory=torch.zeros(3, 64))
    with pytest.raises(ValueError, match=r"context_ids lengths must be 2 integers in \[1, 3\], got \[3, 1.5\]"):
        write_memory(model, [[1, 2, 3], [4, 5, 0]], lengths=[3, 1.5], tokens=1, steps=1, lr=1.0)
    with pytest.raises(ValueError, match="gradmem lr=-1 is invalid"):
        write_memory(model, [1, 2, 3], tokens=2, steps=1, lr=-1)
    with pytest.raises(ValueError, match="gradmem depth=0 is invalid: expected an integer >= 1"):
        write_memory(model, [1, 2, 3], tokens=2, steps=1, lr=1.0, depth=0)
    cfg = rd.ModelConfig.from_preset("tiny", value_embeddings=[0])
    with pytest.raises(ValueError, match="GradMem needs a model without value embeddings"):
        generate(rd.RecurrentDepthLM(cfg), [1, 2, 3], max_new_tokens=1, gradmem_tokens=2)


def test_the_cli_writes_the_memory_and_reports_its_cost(tmp_path, capsys):
    tok = train_tokenizer(["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the dog"] * 2, 300)
    save_tokenizer(tok, tmp_path)
    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320)).save_pretrained(tmp_path)
    prompt = "def add(a, b):\n    return a + b\n"
    args = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "4", "--num-steps", "2",
            "--init-scale", "0", "--gradmem-tokens", "2", "--gradmem-steps", "2", "--gradmem-query-tokens", "1",
            "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    stats = record["stats"]
    n = len(tok.encode(prompt).ids)
    assert stats["gradmem_context_tokens"] == [n - 1] and len(stats["gradmem_losses"]) == 2
    one = training_step_flops(rd.ModelConfig.from_preset("tiny", vocab_size=320), 1, 2 + n - 1, (0, 2))
    assert stats["gradmem_flops"] == 2 * one.total
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path).eval()
    api = generate(model, tok.encode(prompt).ids, max_new_tokens=4, num_steps=2, init_scale=0, seed=0,
                   gradmem_tokens=2, gradmem_steps=2, gradmem_query_tokens=1)
    assert record["tokens"] == api.token_lists()
    assert main(args[:-1] + ["--gradmem-query-tokens", "99"]) == 2
    assert "--gradmem-query-tokens=99 leaves row 0 no context" in capsys.readouterr().err
    assert main(args[:-1] + ["--gradmem-depth", "0"]) == 2
    assert "--gradmem-depth=0 is invalid: expected None or an integer >= 1" in capsys.readouterr().err
