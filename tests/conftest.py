import pytest
import torch

import recurrent_depth as rd


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
