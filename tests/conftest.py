"""Shared test settings and fixtures (the helpers the test files import are in helpers.py).

Tests that spawn processes or train suites are marked ``slow`` (registered in pyproject.toml): ``pytest -m
"not slow"`` is the developer's fast loop (docs/architecture.md); plain ``pytest`` runs everything.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# Hypothesis draws its examples from a seed derived from each test's name, so every run tests the same cases
# (a failure prints the example and its reproduction blob). HYPOTHESIS_PROFILE=random explores new ones.
settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


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
