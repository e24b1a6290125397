"""A user's journey (retrofit, train, LoRA, serve, evaluate) as found: what the CLI lacked against the server."""

from __future__ import annotations

import json
import re

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data import save_tokenizer, train_tokenizer
from recurrent_depth.serving import build_app
from tests.test_serving import CORPUS, LiveServer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def eos_first_dir(tmp_path_factory):
    """A tiny model whose eos is its first greedy token: every plain decode stops at once."""
    out = tmp_path_factory.mktemp("eos_first")
    tok = train_tokenizer(CORPUS, 320)
    save_tokenizer(tok, out)
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320)).eval()
    ids = torch.tensor([tok.encode(PROMPT).ids])
    first = rd.generate(model, ids, max_new_tokens=1, num_steps=2, init_scale=0.0).sequences[0, -1].item()
    model.config.eos_token_id = first
    model.save_pretrained(out)
    return out


def _generate(capsys, model_dir, *flags: str) -> dict:
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "5",
                 "--num-steps", "2", "--init-scale", "0", "--threads", "1", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_ignore_eos_gives_the_servers_ignore_eos_tokens(eos_first_dir, capsys):
    """`rdepth generate` always stopped at the model's eos, so a served request with `ignore_eos` (the server's
    field) had no CLI equivalent to check it against; `--ignore-eos` is that equivalent."""
    plain = _generate(capsys, eos_first_dir)
    assert plain["finish_reasons"] == ["stop"] and plain["stats"]["new_tokens"] == 1
    ignored = _generate(capsys, eos_first_dir, "--ignore-eos")
    assert ignored["finish_reasons"] == ["length"] and ignored["stats"]["new_tokens"] == 5
    with LiveServer(build_app(eos_first_dir, model_name="tiny", tokenizer_workers=1)) as live:
        served = live.client().completions.create(
            model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
            extra_body={"num_steps": 2, "init_scale": 0, "ignore_eos": True}).choices[0]
    assert served.finish_reason == "length" and served.text == ignored["completions"][0]


def test_info_states_the_serving_pools_window_bound(tmp_path, capsys, monkeypatch):
    """`rdepth info` said the serving pool holds a windowed layer's whole context, while the pool holds 2W+15
    columns a row (W its largest window): the memory a user sized a server by was the context's."""
    from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV
    from recurrent_depth.inference.options import GenerationOptions
    from recurrent_depth.serving.batch import BatchDecoder, RowRequest

    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    config = rd.ModelConfig.from_preset("tiny", attention_windows=[8, None, 8, 8])
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--threads", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "sliding windows" in x)
    held = int(re.search(r"at most 2W\+(\d+) columns of each", line).group(1)) + 2 * 8
    assert "the serving pool as many a row" in line
    assert "serving pool hold" not in line
    torch.manual_seed(0)
    dec = BatchDecoder(rd.RecurrentDepthLM(config).eval(), max_rows=1)
    opts = GenerationOptions(num_steps=2, init_scale=0.0).validate(config.mean_recurrence)
    seq = dec.add(RowRequest(list(range(40)), opts, 0, top_logprobs=0), tag=0)[0]
    for _ in range(30):
        dec.step()
    assert len(dec) == 1 and seq is not None and dec.pool.held == held < 40 + 30


def test_rdepth_lm_eval_keeps_the_users_include_path_and_ours(tmp_path):
    """`rdepth lm-eval run --include_path DIR` passed lm-eval "DIR:<our tasks>", which its TaskManager reads as
    one path: neither the user's tasks nor the rd_* ones were found ("Tasks not found")."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from recurrent_depth.cli.lm_eval import prepare_argv, split_include_paths

    (tmp_path / "mine.yaml").write_text("task: journey_mine\ndataset_path: json\noutput_type: multiple_choice\n"
                                        "doc_to_text: q\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    argv = prepare_argv(["run", "--include_path", str(tmp_path)], cuda_available=False)
    joined = argv[argv.index("--include_path") + 1]
    with split_include_paths():
        tasks = TaskManager(include_path=joined, include_defaults=False).all_tasks
    assert "journey_mine" in tasks and "rd_chains_mc" in tasks
    # lm-eval alone (the patch undone on exit) reads the joined string as one path: nothing found
    assert TaskManager(include_path=joined, include_defaults=False).all_tasks == []
