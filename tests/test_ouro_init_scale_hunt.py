"""An explicit init_scale on an Ouro model (s_0 = its embedding) is refused in one line, as warm start is.

Ouro's s_0 is e = wte(x) (`state_init="embedding"`): `init_scale` scales a random s_0 that this model never
draws, so `generate(..., init_scale=5.0)` ran and returned the very logits of init_scale 0 (measured: equal
tensors) without a word. Now a scale other than the config's own (the default) and 0 (a deterministic s_0,
which e is; RL rollouts pass it for every model) is refused through `rd.generate`, the CLI and HTTP.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import recurrent_depth as rd
from recurrent_depth.cli import main

GOLDEN = Path(__file__).parent / "goldens" / "ouro" / "config_a"
IDS = torch.tensor([[3, 5, 7, 9]])
REFUSAL = r"^init_scale=5\.0 scales a random s_0, but this model starts from its embedding \(state_init='embedding'"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ouro() -> rd.RecurrentDepthLM:
    return rd.RecurrentDepthLM.from_pretrained(GOLDEN, dtype=torch.float32).eval()


def test_generate_refuses_a_scale_the_embedding_state_ignores(ouro):
    assert ouro.config.state_init == "embedding" and ouro.config.init_scale == 1.0
    with pytest.raises(ValueError, match=REFUSAL) as info:
        rd.generate(ouro, IDS, max_new_tokens=2, init_scale=5.0)
    assert "\n" not in str(info.value)
    # unset, the config's own and 0 (deterministic, as s_0 = e is) all run, and all start from e
    kw = dict(max_new_tokens=2, output_logits=True)
    unset = rd.generate(ouro, IDS, **kw).logits
    for scale in (1.0, 0.0):
        assert torch.equal(rd.generate(ouro, IDS, init_scale=scale, **kw).logits, unset)


def test_a_random_state_model_still_takes_any_scale():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    kw = dict(max_new_tokens=2, output_logits=True, seed=3)
    assert not torch.equal(rd.generate(model, IDS, init_scale=5.0, **kw).logits,
                           rd.generate(model, IDS, init_scale=0.0, **kw).logits)


def ouro_dir(tmp_path: Path) -> Path:
    """The golden Ouro directory (its own config.json and tensors) with a word-level tokenizer."""
    import shutil

    out = tmp_path / "ouro"
    shutil.copytree(GOLDEN, out)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


def test_the_cli_names_its_flag(tmp_path, capsys):
    directory = ouro_dir(tmp_path)
    argv = ["generate", "--model", str(directory), "--prompt", "w3 w5", "--max-new-tokens", "2", "--threads", "1"]
    assert main([*argv, "--init-scale", "5"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: --init-scale=5.0 scales a random s_0" in errors[0], err
    assert main([*argv, "--init-scale", "0"]) == 0


def test_http_is_a_400_naming_the_field(tmp_path):
    from recurrent_depth.serving import build_app
    from tests.test_serving import LiveServer

    app = build_app(str(ouro_dir(tmp_path)), tokenizer_workers=1)
    body = dict(prompt=[[3, 5, 7]], max_tokens=2, temperature=0)
    with LiveServer(app) as live:
        url = live.url + "/v1/completions"
        refused = httpx.post(url, json={**body, "init_scale": 5.0}, timeout=60)
        plain = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "init_scale" and "init_scale=5.0 scales a random s_0" in error["message"], error
    assert plain.status_code == 200, plain.text


def test_the_forward_refuses_it_too(ouro):
    """`rdepth eval`, `rdepth analyze` and users' own loops call the forward: it was ignored there as well."""
    with pytest.raises(ValueError, match=REFUSAL):
        ouro(IDS, init_scale=5.0)
    assert torch.equal(ouro(IDS, init_scale=0.0).logits, ouro(IDS).logits)
