"""Pools of ranks per (backend, world size); see harness.py.

TRITON_OVERLAP_TEST_BACKENDS picks the configurations, e.g. "host:2,host:3,host:4,cuda:2"
(the default). GPU configurations skip where the machine has fewer GPUs.
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
    return get_pool(backend, world)
