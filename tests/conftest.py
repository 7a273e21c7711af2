"""Shared test setup: every RNG seeded, GPU tests skipped where there is no GPU.

Each run draws fresh random inputs: the run seed is random unless FLASHSERVE_TEST_SEED is set,
and is printed in the header so a failure can be replayed.
"""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter; Triton reads this when a kernel
# is defined (module import), so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# pytest-xdist's workers (``make test`` runs two) share the machine's cores: each worker's torch,
# and through OMP_NUM_THREADS the servers and scripts it starts, take their share (at two threads
# a process on two cores the server test files took 2.5-4x their time in one process).
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _threads = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

RUN_SEED = int(os.environ.get("FLASHSERVE_TEST_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist's workers (``make test`` runs two) start from this process's environment: one
# seed for the whole run, the one the header prints
os.environ["FLASHSERVE_TEST_SEED"] = str(RUN_SEED)


def pytest_report_header(config):
    return f"flashserve test seed: FLASHSERVE_TEST_SEED={RUN_SEED}"


@pytest.fixture(autouse=True)
def _seed_everything(request):
    seed = (zlib.crc32(request.node.nodeid.encode()) ^ RUN_SEED) % (2**31)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
