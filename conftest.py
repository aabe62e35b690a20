"""pytest setup.
- Without a GPU, run the Triton kernel (kernel.py) in triton's CPU interpreter. triton reads
  TRITON_INTERPRET when a kernel is decorated, so this must happen before any test module
  imports kernel.py.
- Under `pytest -n 2` (pytest-xdist) each worker, and each script a test starts, uses one thread:
  two workers of two threads would oversubscribe 2 cores.
- Tests marked slow (over a minute on 2 CPU cores) run only with --slow."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))  # bench.py and the tools

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: over a minute on 2 CPU cores; runs only with --slow")


def pytest_collection_modifyitems(config, items):
    # the longest test (--fast reproduction, ~5 min) first: under -n 2 the other worker runs the rest beside it
    items.sort(key=lambda item: item.name != "test_reproduce_fast_writes_every_result")
    if not config.getoption("--slow"):
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow: run with --slow"))
