import os

# MKL picks its matrix kernels by CPU (AVX2, AVX-512, AMX), and their float rounding differs; the goldens
# (official Huginn outputs, adaptive-exit step counts that sit near a threshold) were recorded with its
# AVX2 kernels. Conditional numerical reproducibility pins that path on every x86 machine, so a
# test gives the same numbers on an AVX-512 machine as on an AVX2 one. STRICT also makes a row's result
# independent of how many rows share a product (the one-rank vs two-rank tests compare bit for bit).
# Given the thread count, results are then the same on every x86 CPU; tests/test_official_golden.py
# pins its own (`two_threads`). Set before torch makes its first MKL call; subprocesses inherit it.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

# Quantized decoding compiles its kernels at first use (recurrent_depth/accel/quant.py), 10-30 s a
# variant; the suite runs them eagerly, and tests/test_quant_cache.py compiles them once, on purpose.
os.environ.setdefault("RDEPTH_NO_COMPILE", "1")
os.environ.setdefault("RDEPTH_NO_CPP", "1")  # the C++ read (accel/quant_cpp.py): built in test_quant_cpp.py

import recurrent_depth as rd
from tests.train_support import OneThread


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module, restored after it: tests run tiny matmuls, which two intra-op
    threads on a shared 2-core machine run many times slower; results do not depend on it."""
    with OneThread():
        yield


@pytest.fixture(scope="module")
def two_threads():
    """Two torch threads for a module, restored after it (see `two_threads` in tests/test_official_golden.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_config() -> rd.ModelConfig:
    return rd.ModelConfig.from_preset("tiny")


@pytest.fixture
def tiny_model(tiny_config) -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(tiny_config).eval()
