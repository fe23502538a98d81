"""Shared fixtures."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process torch work on one thread (tiny models; keeps timings stable on 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
