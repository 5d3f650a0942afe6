"""Pools of ranks per (backend, world size); see harness.py.

TRITON_OVERLAP_TEST_BACKENDS picks the configurations, e.g. "host:2,host:3,host:4,cuda:2"
(the default). GPU configurations skip where the machine has fewer GPUs. "cuda-shared:W" runs W ranks on one
GPU (harness.py): the cuda backend's protocol checked where only one GPU is lent, slowly, and never timed.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import get_pool, gpu_count  # noqa: E402


def _configs():
    spec = os.environ.get("TRITON_OVERLAP_TEST_BACKENDS", "host:2,host:3,host:4,cuda:2")
    out = []
    for item in spec.split(","):
        backend, world = item.strip().split(":")
        out.append((backend, int(world)))
    return out


CONFIGS = _configs()


@pytest.fixture(params=CONFIGS, ids=[f"{b}-w{w}" for b, w in CONFIGS])
def pool(request):
    backend, world = request.param
    if backend in ("cuda", "hip") and gpu_count() < world:
        pytest.skip(f"needs {world} GPUs")
    if backend == "cuda-shared" and gpu_count() < 1:
        pytest.skip("needs a GPU")
    return get_pool(backend, world)
