"""TTT-E2E (inference/ttt_e2e.py): test-time gradient steps on a weight subset, then generation.

The base model is never written (its shadow holds the updated weights): checked bit for bit after
a request, after a request that fails in its inner loop and after one that fails while generating;
0 steps equals plain generation; the inner loop lowers the context's loss; concurrent server
requests each equal their request alone, and a plain request beside them equals its plain answer.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import ttt_e2e
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer, model_dir, reference  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 99, 3, 250, 17, 42, 99, 3, 77, 12, 17, 42]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_zero_steps_equals_plain_generation(tiny_model):
    plain = rd.generate(tiny_model, [PROMPT], max_new_tokens=6, seed=3, output_logits=True)
    ttt = rd.generate(tiny_model, [PROMPT], max_new_tokens=6, seed=3, output_logits=True,
                      ttt_params="all", ttt_steps=0)
    assert ttt.token_lists() == plain.token_lists()
    assert torch.equal(ttt.logits, plain.logits)
    assert ttt.stats["ttt_flops"] == 0 and ttt.stats["ttt_losses"] == []


def test_steps_change_generation_and_leave_base_bit_identical(tiny_model):
    saved = snapshot(tiny_model)
    plain = rd.generate(tiny_model, [PROMPT], max_new_tokens=6, init_scale=0, output_logits=True)
    out = rd.generate(tiny_model, [PROMPT], max_new_tokens=6, init_scale=0, output_logits=True,
                      ttt_params="core-mlp", ttt_steps=3, ttt_lr=0.05, ttt_optimizer="adam")
    assert same(tiny_model, saved)
    assert not torch.allclose(out.logits, plain.logits)
    stats = out.stats
    assert stats["ttt_steps"] == 3 and len(stats["ttt_losses"]) == 3 and stats["ttt_depth"] == [2, 2]
    depth_flops = rd.train.flops.training_step_flops(tiny_model.config, 1, len(PROMPT), (2, 2)).total
    assert stats["ttt_flops"] == pytest.approx(3 * depth_flops)
    # the copy: 2 core blocks x (fc + proj) weights, x4 with Adam (weights, gradients, two moments)
    mlp = sum(p.numel() for n, p in tiny_model.named_parameters() if ".core_block." in n and ".mlp." in n)
    assert stats["ttt_copy_mb"] == round(mlp * 4 * 4 / 2**20, 3)
    again = rd.generate(tiny_model, [PROMPT], max_new_tokens=6, init_scale=0, output_logits=True)
    assert torch.equal(again.logits, plain.logits)  # the next plain request reads the base weights


def test_failing_request_leaves_base_bit_identical(tiny_model, monkeypatch):
    saved = snapshot(tiny_model)
    real = ttt_e2e.context_loss
    calls = []

    def fails_on_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in the inner loop")
        return real(*args, **kwargs)

    monkeypatch.setattr(ttt_e2e, "context_loss", fails_on_third_step)
    with pytest.raises(RuntimeError, match="injected failure"):
        rd.generate(tiny_model, [PROMPT], max_new_tokens=4, ttt_params="all", ttt_steps=5, ttt_lr=0.5)
    assert len(calls) == 3 and same(tiny_model, saved)
    monkeypatch.setattr(ttt_e2e, "context_loss", real)

    def streamer(event):
        raise RuntimeError("injected failure while generating")

    with pytest.raises(RuntimeError, match="while generating"):
        rd.generate(tiny_model, [PROMPT], max_new_tokens=4, ttt_params="all", ttt_steps=2, ttt_lr=0.5,
                    streamer=streamer)
    assert same(tiny_model, saved)


def test_a_per_row_seed_list_reproduces_like_its_int(tiny_model):
    """seed=[s] (one seed per row) is seed=s for the one row: the inner loop's s_0 must not fall back to torch's
    global RNG (unreproducible)."""
    kwargs = dict(max_new_tokens=3, ttt_params="all", ttt_steps=2, ttt_lr=0.01)
    by_int = rd.generate(tiny_model, [PROMPT], seed=5, **kwargs)
    torch.manual_seed(0)
    by_list = rd.generate(tiny_model, [PROMPT], seed=[5], **kwargs)
    torch.manual_seed(1)
    again = rd.generate(tiny_model, [PROMPT], seed=[5], **kwargs)
    assert by_list.stats["ttt_losses"] == by_int.stats["ttt_losses"] == again.stats["ttt_losses"]
    assert by_list.token_lists() == by_int.token_lists()


def test_inner_steps_lower_the_context_loss(tiny_model):
    opts = GenerationOptions(ttt_params="core", ttt_steps=4, ttt_lr=0.02, ttt_optimizer="adam", seed=0,
                             init_scale=0).validate(tiny_model.config.mean_recurrence)
    result = ttt_e2e.adapt(tiny_model, torch.tensor([PROMPT]), opts, final_loss=True)
    assert len(result.losses) == 5 and result.losses[-1] < result.losses[0] - 0.1
    names = set(result.parameters)
    assert "transformer.adapter.weight" in names and not any(".coda." in n for n in names)


def test_tied_embedding_stays_tied_in_the_shadow(tiny_model):
    shadow, params = ttt_e2e.shadow_model(tiny_model, ["transformer.wte.weight"])
    assert len(params) == 1 and shadow.transformer.wte.weight is params[0]
    assert shadow.transformer.wte.weight is not tiny_model.transformer.wte.weight
    assert shadow.transformer.core_block[0].mlp.fc.weight is tiny_model.transformer.core_block[0].mlp.fc.weight


@pytest.mark.parametrize("kwargs, message", [
    ({"ttt_params": "transformer.nothing.*"}, "matches no parameter"),
    ({"ttt_params": ""}, "ttt_params='' is invalid"),
    ({"ttt_params": "core", "ttt_lr": 0}, "ttt_lr=0 is invalid"),
    ({"ttt_params": "core", "ttt_optimizer": "rmsprop"}, "ttt_optimizer='rmsprop' is invalid"),
    ({"ttt_params": "core", "ttt_steps": -1}, "ttt_steps=-1 is invalid"),
    ({"ttt_params": "core", "num_steps": 3, "ttt_backprop": 5}, "ttt_backprop=5 is invalid"),
    # depth 0: the core's weights get no gradient, and the steps and their FLOPs were counted regardless
    ({"ttt_params": "core-mlp", "num_steps": 0, "ttt_steps": 2}, r"ttt_params='core-mlp' get no gradient at "
                                                                 r"the inner depth \(0, 0\)"),
])
def test_bad_options_get_one_line_errors(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        rd.generate(tiny_model, [PROMPT], max_new_tokens=2, **kwargs)
    assert "\n" not in str(info.value)


def test_a_diverging_learning_rate_is_a_one_line_error_not_nan_weights(tiny_model):
    """A step whose weights or loss go non-finite would generate garbage (argmax of NaN logits) with NaN
    stats (invalid JSON): refused, naming ttt_lr, and the base weights are untouched."""
    saved = snapshot(tiny_model)
    with pytest.raises(ValueError, match="ttt_lr=1e\\+30 made the inner loop diverge") as info:
        rd.generate(tiny_model, [PROMPT], max_new_tokens=2, seed=0, ttt_params="all", ttt_steps=3, ttt_lr=1e30)
    assert "\n" not in str(info.value) and same(tiny_model, saved)


def test_batch_of_prompts_is_refused(tiny_model):
    with pytest.raises(ValueError, match="one prompt"):
        rd.generate(tiny_model, [PROMPT, PROMPT], max_new_tokens=2, ttt_params="core")


# ------------------------------------------------------------------------------------ the server
REQUESTS = [  # (prompt ids, TTT fields): different contexts and learning rates, and one plain request
    ([7, 8, 9, 10, 11, 12, 7, 8, 9, 10], {"ttt_params": "core-mlp", "ttt_steps": 3, "ttt_lr": 0.3}),
    ([40, 41, 40, 41, 40, 41, 40, 41], {"ttt_params": "core-mlp", "ttt_steps": 2, "ttt_lr": 0.05,
                                         "ttt_optimizer": "adam"}),
    ([7, 8, 9, 10, 11, 12, 7, 8, 9, 10], {}),
]


@pytest.fixture(scope="module")
def ttt_server(model_dir):  # noqa: F811
    """A server whose copy limit (1.2 MiB) takes the core's MLPs with Adam (1.03 MiB) but not 'all' (1.76)."""
    server_model = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    app = build_app(server_model, model_name="tiny", tokenizer_dir=model_dir, tokenizer_workers=1,
                    ttt_max_copy_mb=1.2)
    with LiveServer(app) as live:
        yield live, server_model


def test_concurrent_server_requests_do_not_see_each_other(ttt_server, reference):  # noqa: F811
    live, server_model = ttt_server
    model, _ = reference
    saved = snapshot(model)
    expected = []
    for prompt, fields in REQUESTS:
        out = rd.generate(model, [prompt], max_new_tokens=6, seed=11, eos_token_id=[], **fields)
        expected.append((out.token_lists()[0], out.stats.get("ttt_flops")))
    assert same(model, saved)
    assert expected[0][0] != expected[2][0]  # TTT-E2E changes the answer, so a leak would show

    async def fire():
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
            bodies = [{"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "seed": 11,
                       "ignore_eos": True, "logprobs": 0, **fields} for prompt, fields in REQUESTS]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    before = snapshot(server_model)
    answers = asyncio.run(fire())
    assert same(server_model, before)
    tokenizer = reference[1]
    for answer, (tokens, flops) in zip(answers, expected):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["text"] == tokenizer.decode(tokens)
        assert body["usage"].get("ttt_flops") == flops


def test_server_refuses_a_copy_over_its_limit(ttt_server):
    live, _ = ttt_server

    def post(subset: str) -> httpx.Response:
        return httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                              "ttt_params": subset})

    ok, big, bad = post("transformer.ln_f.weight"), post("all"), post("nope.*")
    assert ok.status_code == 200, ok.text
    assert big.status_code == 400 and "--ttt-max-copy-mb" in big.json()["error"]["message"]
    assert bad.status_code == 400 and "matches no parameter" in bad.json()["error"]["message"]


def test_server_answers_a_diverging_inner_loop_with_a_400(ttt_server, monkeypatch):
    live, server_model = ttt_server
    real = ttt_e2e.context_loss
    monkeypatch.setattr(ttt_e2e, "context_loss", lambda *a, **k: real(*a, **k) * float("nan"))  # lr too large
    before = snapshot(server_model)
    answer = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                                            "ttt_params": "core-mlp", "ttt_lr": 100})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"].startswith("ttt_lr=100 made the inner loop diverge")
    assert same(server_model, before)


def test_scheduler_admits_one_ttt_request_at_a_time(tiny_model):
    from types import SimpleNamespace

    from recurrent_depth.serving.engine import BatchScheduler

    def job(name: str, trains: bool) -> SimpleNamespace:
        return SimpleNamespace(name=name, trains=trains, row=SimpleNamespace(prompt=[1, 2, 3]), served_adapter=None,
                               peft_adapter=None)

    scheduler = BatchScheduler(tiny_model, max_batch=8)
    scheduler.waiting.extend([job("ttt-1", True), job("ttt-2", True), job("plain", False), job("ttt-3", True)])
    assert [j.name for j in scheduler._take_admissible()] == ["ttt-1", "plain"]
    assert [j.name for j in scheduler.waiting] == ["ttt-2", "ttt-3"]  # held, in their order
    scheduler.solos.append((job("ttt-1", True), None))
    assert scheduler._take_admissible() == [] and len(scheduler.waiting) == 2
    scheduler.solos.clear()  # the first finished: the next one starts
    assert [j.name for j in scheduler._take_admissible()] == ["ttt-2"]


def test_cli_generate_takes_the_ttt_flags(model_dir, reference, capsys):  # noqa: F811
    from recurrent_depth.cli import main

    model, tokenizer = reference
    flags = ["--ttt-params", "core-mlp", "--ttt-steps", "2", "--ttt-lr", "0.2", "--init-scale", "0"]
    assert main(["generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "5",
                 *flags]) == 0
    captured = capsys.readouterr()
    ids = tokenizer.encode("def add(a, b):").ids
    out = rd.generate(model, [ids], max_new_tokens=5, init_scale=0.0, seed=0, tokenizer=tokenizer,
                      ttt_params="core-mlp", ttt_steps=2, ttt_lr=0.2)
    assert captured.out == "def add(a, b):" + tokenizer.decode(out.token_lists()[0]) + "\n"
    assert f"ttt_flops={out.stats['ttt_flops']}" in captured.err
    assert main(["generate", "--model", str(model_dir), "--prompt", "x y", "--ttt-params", "nope.*"]) == 2
    assert "--ttt-params='nope.*' is invalid" in capsys.readouterr().err


def test_adapters_that_are_off_are_neither_copied_nor_trained(tmp_path):
    """On a `--lora-modules` server every adapter sits on the model and one (or none) is on: `ttt_params` took
    the others' LoRA tensors too, which change no output but were copied and counted against the copy limit."""
    from recurrent_depth.train.lora import LoraSpec, add_lora, load_loras, save_adapter, use_adapter

    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).save_pretrained(tmp_path / "base")
    for i in range(2):
        save_adapter(add_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base"), LoraSpec(rank=2),
                              base_dir=tmp_path / "base", seed=i), tmp_path / f"a{i}")
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "base")
    plain = ttt_e2e.select_parameters(model, "core")
    wrapper = load_loras(model, [tmp_path / "a0", tmp_path / "a1"])
    assert [n.replace(".base_layer", "") for n in ttt_e2e.select_parameters(model, "core")] == plain  # all off
    use_adapter(wrapper, "lora0_")
    chosen = ttt_e2e.select_parameters(model, "core")
    assert any("lora0_" in n for n in chosen) and not any("lora1_" in n for n in chosen)
