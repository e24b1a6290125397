"""Ouro's learned exit gate as a runtime exit criterion, and the KV of the steps an exited token skips.

The references are written here: the exit rule of `OuroForCausalLM.forward(exit_threshold=q)` (pdf
p_t = lambda_t prod_{j<t} (1 - lambda_j), the last step the remaining mass, exit at the first step
whose cumulative p reaches q), the reference's loop (every token runs all T steps: a full forward of
the whole sequence, read at the last position's exit step) and a real early exit under the deepest
lookup (a depth replay of the recorded steps, `model/replay.py`).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.criteria import ExitCriterion, resolve_criterion
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.model.replay import DepthReplay
from tests.batch_support import serve_in_one_batch

pytestmark = pytest.mark.usefixtures("one_thread")
T = 4  # tiny-ouro's total_ut_steps (mean_recurrence)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    """tiny-ouro (vocab 320) with every weight perturbed, so the gate's lambdas spread over (0, 1)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=320))  # room for a tokenizer
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        model.transformer.exit_gate.weight.mul_(20)  # lambdas of every size, not all near 0.5
    return model.eval()


def reference_exit(lambdas: list[float], q: float) -> int:
    """The reference's exit step (1-based) for one position's per-step lambdas."""
    pdf, remaining = [], 1.0
    for t, lam in enumerate(lambdas):
        if t < len(lambdas) - 1:
            pdf.append(lam * remaining)
            remaining *= 1.0 - lam
        else:
            pdf.append(remaining)
    cumulative = torch.cumsum(torch.tensor(pdf), 0)
    reached = (cumulative >= q).nonzero()
    return int(reached[0]) + 1 if len(reached) else len(lambdas)


def test_the_gate_criterion_is_the_reference_rule():
    """Many rows of random lambdas, several q: the criterion's first met step is the reference's."""
    gen = torch.Generator().manual_seed(0)
    lambdas = torch.rand(200, T, generator=gen) ** 3  # many small lambdas: exits at every step
    for q in (0.05, 0.3, 0.5, 0.8, 1.0):
        crit = ExitCriterion(*resolve_criterion("gate", q), gate=lambda s: s[:, 0])
        crit.start(torch.zeros(200, 1), vocab_size=2)
        exit_at = torch.full((200,), T)
        for t in range(T - 1):  # the last step always exits (the engine stops at max_steps)
            met = crit.update(lambdas[:, t : t + 1], None)
            exit_at = torch.where(met & (exit_at == T), t + 1, exit_at)
        want = [reference_exit(row.tolist(), q) for row in lambdas]
        assert exit_at.tolist() == want
    assert len(set(want)) >= 1 and len({reference_exit(r.tolist(), 0.5) for r in lambdas}) == T


def next_token_reference(model, seq: torch.Tensor, q: float) -> tuple[int, int]:
    """The reference's loop for the last position: every step of every token runs (a full forward),
    logits from the state of the exit step. Returns (token, exit step)."""
    out = model(seq[None], num_steps=T, output_all_states=True)
    states = out.all_states[1:, 0, -1]  # [T, h]: the last position after each step
    step = reference_exit(model.exit_probability(states).tolist(), q)
    ctx = model.make_context(seq[None])
    logits = model.predict(model.latent(states[step - 1][None, None]), ctx)[0, -1]
    return int(logits.argmax()), step


@pytest.mark.parametrize("q", [0.35, 0.7])
@torch.no_grad()
def test_exit_kv_compute_is_the_reference_loop(model, q):
    prompts = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    out = rd.generate(model, prompts, max_new_tokens=6, exit_criterion="gate", exit_threshold=q, exit_kv="compute")
    for b in range(2):
        seq, steps = prompts[b], []
        for _ in range(6):
            token, step = next_token_reference(model, seq, q)
            seq = torch.cat([seq, torch.tensor([token])])
            steps.append(step)
        assert out.sequences[b].tolist() == seq.tolist()
        assert out.steps[b].tolist() == steps
    assert len(set(out.steps.flatten().tolist())) > 1  # the gate really chose different depths
    assert out.core_cache_bytes.tolist() == rd.generate(model, prompts, max_new_tokens=6).core_cache_bytes.tolist()


@pytest.mark.parametrize("q", [0.35, 0.7])
@torch.no_grad()
def test_a_real_exit_reads_skipped_steps_at_the_deepest_entry(model, q):
    """exit_kv="lookup": a token stops at its exit step; later tokens read its deepest entry for deeper
    steps (a depth replay of the recorded depths). The prompt runs at full depth."""
    prompt = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(3))
    out = rd.generate(model, prompt, max_new_tokens=6, exit_criterion="gate", exit_threshold=q)
    seq, depths = prompt, [T] * len(prompt)
    for j in range(6):
        if j == 0:  # the first token: the prompt's last position at full depth
            token, step = int(model(seq[None], num_steps=T).logits[0, -1].argmax()), T
        else:  # the newest position at each depth d, the others at theirs
            runs = [model(seq[None], replay=DepthReplay(torch.tensor([depths[:-1] + [d]]))) for d in range(1, T + 1)]
            lambdas = [float(model.exit_probability(r.latent_states[0, -1])) for r in runs]
            step = reference_exit(lambdas, q)
            token = int(runs[step - 1].logits[0, -1].argmax())
            depths[-1] = step
        assert (out.sequences[0, len(seq)].item(), out.steps[0, j].item()) == (token, step), j
        seq = torch.cat([seq, torch.tensor([token])])
        depths.append(T)
    assert len(set(out.steps[0].tolist())) > 1
    full = rd.generate(model, prompt, max_new_tokens=6).core_cache_bytes[0]
    assert out.core_cache_bytes[0] < full  # the skipped steps hold no entries of their own


def test_a_batch_equals_its_rows_alone_in_the_server(model):
    """Requests with different q, KV rules and policies in one continuous batch: each row's tokens and
    per-token steps equal the request generated alone."""
    gen = torch.Generator().manual_seed(4)
    kinds = [dict(exit_threshold=0.3), dict(exit_threshold=0.6, exit_kv="compute"), dict(exit_threshold=0.9),
             dict(exit_threshold=0.5, kv_policy="last-step"), dict(exit_threshold=0.5, exit_kv="compute",
                                                                   kv_policy="last-step"), dict()]
    jobs = [(torch.randint(0, 256, (3 + j,), generator=gen).tolist(),
             dict(max_new_tokens=5, exit_criterion="gate", **kw)) for j, kw in enumerate(kinds)]
    jobs.append((jobs[0][0], dict(max_new_tokens=5)))  # a fixed-depth row among them
    served = serve_in_one_batch(model, jobs)
    seen = set()
    for j, (prompt, kw) in enumerate(jobs):
        alone = rd.generate(model, torch.tensor(prompt), **kw)
        assert [r.token for r in served[j]] == alone.token_lists()[0], j
        assert [r.steps for r in served[j]] == alone.steps[0].tolist(), j
        seen |= set(alone.steps[0].tolist())
    assert {1, 2, 3, 4} <= seen


@torch.no_grad()
def test_prefill_then_decode_equals_the_full_forward_at_fixed_depth(model):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    full = model(ids, num_steps=T).logits
    for policy in ("per-step", "last-step"):
        out = rd.generate(model, ids[:, :6], max_new_tokens=4, teacher_tokens=ids[:, 6:], output_logits=True,
                          kv_policy=policy)
        if policy == "per-step":
            torch.testing.assert_close(out.logits[:, :4], full[:, 5:9], rtol=1e-4, atol=1e-4)
        else:  # one entry per core layer: a token's step i reads the others' last step, not their step i
            assert not torch.allclose(out.logits[:, 1:4], full[:, 6:9], atol=1e-3)


def test_bad_input_is_a_one_line_error(model):
    ids = torch.tensor([[1, 2, 3]])
    huginn = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    cases = [
        (model, dict(exit_criterion="gate", exit_threshold=0.0), r"\(0, 1\]"),
        (model, dict(exit_criterion="gate", exit_threshold=1.5), r"\(0, 1\]"),
        (model, dict(exit_criterion="gate", exit_threshold=float("nan")), "exit_threshold"),
        (huginn, dict(exit_criterion="gate"), "has none"),
        (model, dict(exit_criterion="gate", check_every=2), "check_every=1"),
        (model, dict(exit_kv="compute"), "needs an exit_criterion"),
        (model, dict(exit_criterion="gate", exit_kv="compute", exit_in_prefill=True), "exit_in_prefill"),
        (model, dict(exit_kv="everything", exit_criterion="gate"), "exit_kv"),
    ]
    for m, kw, needle in cases:
        with pytest.raises(ValueError, match=needle) as info:
            rd.generate(m, ids, max_new_tokens=2, **kw)
        assert "\n" not in str(info.value), kw
    with pytest.raises(ValueError, match="has none"):
        serve_in_one_batch(huginn, [([1, 2], dict(max_new_tokens=2, exit_criterion="gate"))])
    assert GenerationOptions(exit_criterion="gate").validate(4).threshold == 1.0  # the reference's default


# ---------------------------------------------------------------------------------------- interfaces
@pytest.fixture(scope="module")
def ouro_dir(model, tmp_path_factory):
    """The model above saved by our save_pretrained, with a tiny tokenizer: what --model takes."""
    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    path = tmp_path_factory.mktemp("ouro")
    model.save_pretrained(path)
    save_tokenizer(train_tokenizer(["def add(a, b):\n    return a + b\n" * 8, "for i in range(10): pass\n" * 8], 300),
                   path)
    return path


def test_the_cli_generates_with_the_gate(ouro_dir, model, capsys):
    from recurrent_depth.cli import main
    from recurrent_depth.data.tokenizer import load_tokenizer

    ids = load_tokenizer(ouro_dir).encode("def add(a").ids
    argv = ["generate", "--model", str(ouro_dir), "--prompt", "def add(a", "--max-new-tokens", "5",
            "--exit-criterion", "gate", "--exit-threshold", "0.5", "--exit-kv", "compute", "--json", "--threads", "1"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    alone = rd.generate(model, torch.tensor(ids), max_new_tokens=5, exit_criterion="gate", exit_threshold=0.5,
                        exit_kv="compute")
    assert record["tokens"][0] == alone.token_lists()[0] and record["steps"][0] == alone.steps[0].tolist()
    assert main(["generate", "--model", str(ouro_dir), "--prompt", "def", "--exit-criterion", "gate",
                 "--exit-threshold", "1.5"]) == 2
    assert "(0, 1]" in capsys.readouterr().err


def test_http_completions_run_the_gate_in_the_continuous_batch(ouro_dir, model):
    import httpx

    from recurrent_depth.serving import BatchDecoder, build_app
    from tests.test_serving import LiveServer

    assert BatchDecoder.supports(model)  # Ouro's layout runs in the continuous batch, not solo

    prompts = [[3, 40, 41], [7, 8, 9, 10, 11], [100, 101]]
    body = dict(prompt=prompts, max_tokens=5, temperature=0, ignore_eos=True, return_steps=True,
                exit_criterion="gate", exit_threshold=0.6)
    app = build_app(str(ouro_dir), tokenizer_workers=1)
    with LiveServer(app) as live:
        url = live.url + "/v1/completions"
        choices = httpx.post(url, json=body, timeout=60).json()["choices"]
        computed = httpx.post(url, json={**body, "exit_kv": "compute"}, timeout=60).json()["choices"]
    for kv, got in (("lookup", choices), ("compute", computed)):
        for c in got:
            alone = rd.generate(model, torch.tensor(prompts[c["index"]]), max_new_tokens=5, exit_criterion="gate",
                                exit_threshold=0.6, exit_kv=kv)
            assert c["steps"] == alone.steps[0].tolist(), (kv, c["index"])


def test_transformers_generate_routes_the_gate(ouro_dir, model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ouro_dir).eval()
    ids = torch.tensor([[3, 40, 41, 42]])
    for kv in ("lookup", "compute"):
        out = hf.generate(ids, max_new_tokens=5, exit_criterion="gate", exit_threshold=0.5, exit_kv=kv,
                          return_dict_in_generate=True)
        alone = rd.generate(model, ids, max_new_tokens=5, exit_criterion="gate", exit_threshold=0.5, exit_kv=kv)
        assert out.sequences.tolist() == alone.sequences.tolist() and out.steps.tolist() == alone.steps.tolist()


@torch.no_grad()
def test_lm_eval_scores_with_the_reference_loop(ouro_dir, model):
    """exit_kv=compute in lm-eval's scoring: every position of context and continuation runs all T steps
    (a full forward) and each scored one is read at its own exit step."""
    from recurrent_depth.data.tokenizer import load_tokenizer
    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM

    lm = RecurrentDepthEvalLM(pretrained=str(ouro_dir), device="cpu", batch_size=2, exit_criterion="gate",
                              exit_threshold=0.5, exit_kv="compute")
    context, continuation = [3, 40, 41, 42, 43], [50, 51, 52, 53]
    [(logprob, _)] = lm._loglikelihood_tokens([(None, context, continuation)], disable_tqdm=True)
    seq = torch.tensor([context + continuation[:-1]])
    out = model(seq, num_steps=T, output_all_states=True)
    want, steps = 0.0, []
    for j, target in enumerate(continuation):
        p = len(context) - 1 + j
        states = out.all_states[1:, 0, p]
        step = reference_exit(model.exit_probability(states).tolist(), 0.5)
        logits = model.predict(model.latent(states[step - 1][None, None]), model.make_context(seq))[0, -1]
        want += float(torch.log_softmax(logits, -1)[target])
        steps.append(step)
    assert logprob == pytest.approx(want, abs=1e-4)
    assert lm.step_counts["loglikelihood"] == Counter(steps)
    with pytest.raises(ValueError, match="has none"):
        huginn = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320))
        path = ouro_dir.parent / "huginn"
        huginn.save_pretrained(path, tokenizer=load_tokenizer(ouro_dir))
        RecurrentDepthEvalLM(pretrained=str(path), device="cpu", exit_criterion="gate")


def test_the_gate_defaults_to_the_models_own_threshold(model):
    """A config's exit_gate_threshold (Ouro's early_exit_threshold) is the gate's q when a call names none."""
    import dataclasses

    ids = torch.tensor([[5, 9, 2, 7, 3]])
    own = rd.RecurrentDepthLM(dataclasses.replace(model.config, exit_gate_threshold=0.5)).eval()
    own.load_state_dict(model.state_dict())
    run = dict(max_new_tokens=6, exit_criterion="gate", init_scale=0.0)
    def steps(m, **extra):
        return rd.generate(m, ids, **run, **extra).steps.tolist()

    assert steps(own) == steps(own, exit_threshold=0.5) != steps(own, exit_threshold=1.0)  # q = 1: every step
    assert steps(model) == steps(model, exit_threshold=1.0)  # no threshold in the config: the reference's 1.0
    from recurrent_depth.serving.protocol import Limits, validated

    limits = Limits(64, 4, 256, gate_threshold=0.5)

    assert validated({"exit_criterion": "gate"}, {}, 4, limits).threshold == 0.5


@pytest.mark.parametrize("arg", [{"warm_start": True}, {"init_scale": 5.0}])
def test_lm_eval_refuses_what_generate_refuses_on_ouro(ouro_dir, arg):
    """Loglikelihood requests never pass through `generate`: the backend runs the same model checks itself (warm
    start on Ouro scored -17.10 against -14.89 without, silently; init_scale was ignored)."""
    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM

    [(name, value)] = arg.items()
    with pytest.raises(ValueError, match=f"^{name}") as info:
        RecurrentDepthEvalLM(pretrained=str(ouro_dir), device="cpu", **arg)
    assert "\n" not in str(info.value)
