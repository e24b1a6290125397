import pytest
import torch

import recurrent_depth as rd
from tests.train_support import OneThread


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module, restored after it: tests run tiny matmuls, which two intra-op
    threads on a shared 2-core machine run many times slower; results do not depend on it."""
    with OneThread():
        yield


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
