"""Shared test settings."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One data cache (tokenizers, token streams) for the whole session, never the user's ~/.cache."""
    return os.environ.get("BUBBLEFREE_CACHE") or str(tmp_path_factory.getbasetemp() / "bubblefree-cache")


@pytest.fixture
def data_cache(cache_dir, monkeypatch):
    """Point ``$BUBBLEFREE_CACHE`` (and so subprocesses' default cache) at the session cache."""
    monkeypatch.setenv("BUBBLEFREE_CACHE", cache_dir)


@pytest.fixture(autouse=True)
def one_thread():
    """Tests use tiny tensors: a second OpenMP thread buys nothing, and on an oversubscribed machine (2 cores,
    xdist workers, subprocesses) every parallel region can wait a scheduler slice for it (one 30-step SOAP
    trajectory took 21 s with 2 threads under load against 0.02 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
