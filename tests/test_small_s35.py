"""Three small left-overs (session 35).

- `rdepth serve`'s start-up banner said nothing of a `--lora` adapter (the base's name, as if the plain model
  answered) nor of runtime LoRA loading (`--lora-updates-root`): it now names both.
- `rdepth lm-eval --include_path DIR` (any spelling lm-eval's parser takes) skipped a missing folder silently (lm-eval
  only logs it) and an abbreviated `--include DIR` lost the user's folder to the shipped tasks' one: a missing folder
  is one line before anything loads, as `rdepth eval --lm-eval-include-path` says it.
- int8 and int4 layers of zero width (in or out features 0) failed to quantize or run (nf4 was fixed in s34): they
  now return what the float layer does (its bias, or an empty output), C++ on and off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recurrent_depth import weight_quant as wq
from tests.test_weight_quant import cpp_kernels  # noqa: F401 - the fixture

MAKERS = {"int8": wq.Int8WeightLinear.from_linear, "int4": lambda linear: wq.Int4WeightLinear.from_linear(linear, 32)}


# ------------------------------------------------------------------------------------- (c) zero-width int8 / int4
@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("cpp", [False, True])
@pytest.mark.parametrize("fmt", sorted(MAKERS))
@pytest.mark.parametrize("shape", [(0, 6), (6, 0), (0, 0), (64, 0), (0, 64)])  # (in, out); 64: int4's kernel shape
def test_zero_width_int8_int4_layers_quantize_and_run_as_the_float_layer(monkeypatch, request, cpp, fmt, shape):
    if cpp:
        request.getfixturevalue("cpp_kernels")  # (a skip where the C++ kernels cannot build)
    else:
        monkeypatch.setenv("RDEPTH_NO_CPP", "1")
    torch.manual_seed(0)
    in_features, out_features = shape
    linear = nn.Linear(in_features, out_features)
    layer = MAKERS[fmt](linear)
    assert layer.dequantize().shape == (out_features, in_features)
    assert layer.dequantized().weight.shape == (out_features, in_features)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 20):  # a decode step (the C++ product where on) and a prompt (the reference)
            x = torch.randn(2, rows, in_features, dtype=dtype)
            with torch.no_grad():
                torch.testing.assert_close(layer(x), linear.to(dtype)(x))
    x = torch.randn(3, in_features, requires_grad=True)  # the autograd path (QLoRA training's)
    out = layer(x)
    torch.testing.assert_close(out, linear.float()(x))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x))  # no weights: nothing flows back


# ------------------------------------------------------------------------------ (b) rdepth lm-eval --include_path
@pytest.mark.parametrize("spelling", [["--include_path", "{}"], ["--include_path={}"], ["--include", "{}"]])
@pytest.mark.parametrize("command", [["run", "--model", "hf", "--tasks", "x"], ["--tasks", "x"], ["ls", "tasks"]])
def test_lm_eval_names_a_missing_include_path_folder_before_anything_runs(tmp_path, monkeypatch, capsys, spelling,
                                                                           command):
    pytest.importorskip("lm_eval")
    from recurrent_depth.cli import main

    ran = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: ran.append(True))
    (tmp_path / "mine").mkdir()
    missing = tmp_path / "missing"
    folders = f"{tmp_path / 'mine'}:{missing}"  # (the second of two joined folders: each is checked)
    assert main(["lm-eval", *command, *(part.format(folders) for part in spelling)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rdepth lm-eval: error: --include_path {str(missing)!r} does not exist: expected a folder of "
                   f"lm-eval task YAML files")
    assert not ran
    assert main(["lm-eval", *command, *(part.format(tmp_path / "mine") for part in spelling)]) == 0 and ran


def test_lm_eval_keeps_the_users_folder_under_an_abbreviated_or_repeated_include_path():
    from recurrent_depth.cli.lm_eval import prepare_argv
    from recurrent_depth.evaluation.tasks import TASKS_DIR

    # lm-eval reads `--include` as --include_path and the last one given: ours joins that one
    assert prepare_argv(["ls", "tasks", "--include", "mine"], cuda_available=True) == [
        "ls", "tasks", "--include", f"mine:{TASKS_DIR}"]
    assert prepare_argv(["ls", "tasks", "--include_path", "a", "--include_p=b"], cuda_available=True) == [
        "ls", "tasks", "--include_path", "a", f"--include_p=b:{TASKS_DIR}"]


# ------------------------------------------------------------------------------------ (a) rdepth serve's banner
@pytest.mark.usefixtures("one_thread")
def test_serve_banner_names_the_lora_adapter_and_runtime_loading(tmp_path, monkeypatch):
    """--lora-modules' names were in the banner already; --lora's adapter (served under the base's name) and
    --lora-updates-root were not: the banner read as the plain model's."""
    pytest.importorskip("peft")
    import socket
    from types import SimpleNamespace

    import recurrent_depth as rd
    from recurrent_depth.cli import main
    from recurrent_depth.train.lora import LoraSpec, add_lora, save_adapter

    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64)).save_pretrained(tmp_path / "tiny")
    save_adapter(add_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "tiny"), LoraSpec(rank=2, parts=("core",)),
                          base_dir=tmp_path / "tiny"), tmp_path / "updates" / "ad")
    apps = []
    monkeypatch.setattr("recurrent_depth.serving.transport.make_server",
                        lambda app, **kw: apps.append(app) or SimpleNamespace(run=lambda: None))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        serve = ["serve", "--model", str(tmp_path / "tiny"), "--port", str(probe.getsockname()[1])]
    for extra in ([], ["--lora", str(tmp_path / "updates" / "ad")],
                  ["--lora-modules", f"x={tmp_path / 'updates' / 'ad'}", "--served-model-name", "m1", "m2"],
                  ["--lora-updates-root", str(tmp_path / "updates")]):
        assert main([*serve, *extra]) == 0
    plain, single, named, runtime = (app.state.banner("http://127.0.0.1:1") for app in apps)
    assert plain.startswith("rdepth serve: model 'tiny' (") and "LoRA" not in plain
    assert single.startswith("rdepth serve: model 'tiny' with a LoRA adapter on every request (")
    assert named.startswith("rdepth serve: model 'm1' (also as 'm2') with LoRA adapters 'x' (")  # /v1/models' names
    assert f", runtime LoRA loading from {str((tmp_path / 'updates').resolve())!r}, no API key;" in runtime
    assert "runtime" not in named
