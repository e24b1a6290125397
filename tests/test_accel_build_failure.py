"""A C++ build that fails (no compiler, a compile error) falls back with one line that says why: torch's
"Error building extension 'x': <the compile command>" holds the compiler's reason on a later line only, so
the warning and `rdepth info --build-kernels` named a 600-character command and no cause."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from recurrent_depth import weight_quant as wq
from recurrent_depth.accel import quant_cpp

# torch.utils.cpp_extension's message where the compiler is missing (recorded here with CXX=/nonexistent/c++)
COMMAND = ("/nonexistent/c++ -MMD -MF main.o.d -DTORCH_EXTENSION_NAME=rdepth_quant_x -isystem /venv/torch/include "
           "-fPIC -std=c++20 -O3 -march=native -c /cache/rdepth_quant_x/build-1/main.cpp -o main.o ")
NO_COMPILER = (f"Error building extension 'rdepth_quant_x': [1/2] {COMMAND}\nFAILED: [code=127] main.o \n{COMMAND}\n"
               "/bin/sh: 1: /nonexistent/c++: not found\nninja: build stopped: subcommand failed.\n")


def test_the_failure_line_names_the_compilers_reason_not_its_command():
    line = quant_cpp.failure_line(RuntimeError(NO_COMPILER))
    assert line == "RuntimeError: Error building extension 'rdepth_quant_x': /bin/sh: 1: /nonexistent/c++: not found"
    compile_error = (f"Error building extension 'x': [1/2] {COMMAND}\nFAILED: main.o\n{COMMAND}\n"
                     "main.cpp:2:18: error: 'y' was not declared in this scope\n    2 | int f() {{ return y; }}\n"
                     "ninja: build stopped: subcommand failed.\n")
    assert quant_cpp.failure_line(RuntimeError(compile_error)) == (
        "RuntimeError: Error building extension 'x': main.cpp:2:18: error: 'y' was not declared in this scope")
    # other messages keep their first line
    assert quant_cpp.failure_line(ImportError("bad ELF\nmore")) == "ImportError: bad ELF"
    assert quant_cpp.failure_line(RuntimeError("")) == "RuntimeError: "


def test_a_missing_compiler_is_named_by_a_real_build(monkeypatch, tmp_path):
    """torch's own build with a compiler that does not exist: the line says so (no global cache touched)."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(Exception) as failed:
        quant_cpp.compile_extension("rdepth_hunt_no_cxx", tmp_path, source="int f() { return 1; }")
    if not str(failed.value).startswith(quant_cpp.BUILD_ERROR_HEAD):  # (no ninja: torch says so on its first line)
        pytest.skip(f"torch did not run a build here: {quant_cpp.failure_line(failed.value)}")
    line = quant_cpp.failure_line(failed.value)
    assert "\n" not in line and "not found" in line and " -c " not in line, line


def test_a_failing_build_warns_once_with_its_reason_and_the_products_fall_back(monkeypatch, caplog):
    class NoCompiler:
        def load(self):
            raise RuntimeError(NO_COMPILER)

    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    monkeypatch.setattr(quant_cpp, "kernel_cache", NoCompiler)
    monkeypatch.setattr(quant_cpp, "_module", None)
    monkeypatch.setattr(quant_cpp, "_failure", None)
    torch.manual_seed(0)
    linear = nn.Linear(40, 24)
    with caplog.at_level(logging.WARNING, logger=quant_cpp.__name__):
        layer = wq.Int8WeightLinear.from_linear(linear)
        x = torch.randn(3, 40)
        with torch.no_grad():
            assert not layer.uses_cpp(x)
            torch.testing.assert_close(layer(x), layer.dequantized()(x), rtol=0, atol=0)
        assert quant_cpp.load() is None
    assert quant_cpp.failure().endswith("/bin/sh: 1: /nonexistent/c++: not found")
    assert caplog.text.count("are unavailable (RuntimeError") == 1
    assert "/nonexistent/c++: not found" in caplog.text and "-march=native" not in caplog.text


def test_no_cache_directory_falls_back_too(monkeypatch):
    """`kernel_cache()` ran outside the fallback: with no XDG_CACHE_HOME and no home directory (a service account)
    Path.home()'s RuntimeError escaped from the first quantized product instead of the plain paths running."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(quant_cpp.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(quant_cpp, "_module", None)
    monkeypatch.setattr(quant_cpp, "_failure", None)
    assert quant_cpp.load() is None
    assert quant_cpp.failure() == "RuntimeError: Could not determine home directory."
