"""Tuned tables: where they live, how ops find their entry.

A tuned table is a JSON file ``{gpu: {world_size: {op: [{"shape": [...], "config": {...}}]}}}``
written by ``scripts/tune.py`` (the sweeps are ``triton_overlap.tuning``). Two are read, the first match winning:

1. the user cache, ``$TRITON_OVERLAP_TUNED`` or ``~/.cache/triton_overlap/tuned.json``;
2. the table shipped in the package (``triton_overlap/configs/tuned.json``).

Kernel-only tunings (attention tiles; GEMM tiles from ``tune.py --tiles-only``)
are stored under world size "any". A shape matches an entry with the same
shape, else the entry with the same trailing dimensions (K, N for the GEMMs;
K, N, E, topk for the MoE ops, keyed by ops.moe_config.moe_table_shape; Hq,
Hkv, D, causal for attention) whose leading dimension is nearest on a log
scale; entries for the caller's world size are tried before "any" ones, the
user cache before the shipped table. No match: the op's built-in defaults.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

SHIPPED = Path(__file__).parent.parent / "configs" / "tuned.json"


def user_cache() -> Path:
    return Path(os.environ.get("TRITON_OVERLAP_TUNED", Path.home() / ".cache" / "triton_overlap" / "tuned.json"))


def gpu_key(ctx) -> str:
    """The table's GPU key: the device name without vendor prefix, or the backend's name ('host') where kernels are
    interpreted."""
    if ctx.interpreted:
        return ctx.backend
    return torch.cuda.get_device_name(ctx.device).replace("NVIDIA ", "").replace("AMD ", "").replace(" ", "_")


_cache: dict[Path, tuple[float, dict]] = {}


def _load(path: Path) -> dict:
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return {}
    hit = _cache.get(path)
    if hit is None or hit[0] != mtime:
        with open(path) as f:
            hit = _cache[path] = (mtime, json.load(f))
    return hit[1]


def lookup(op: str, gpu: str, world: int, shape) -> dict | None:
    """The tuned config (a dict) for ``op`` at ``shape``, or None."""
    shape = list(shape)
    for path in (user_cache(), SHIPPED):
        by_world = _load(path).get(gpu, {})
        tables = [by_world.get(str(world), {}).get(op, []), by_world.get("any", {}).get(op, [])]
        for entries in tables:  # this world size's tuning before a kernel-only one
            exact = [e for e in entries if e["shape"] == shape]
            if exact:
                return exact[-1]["config"]
        for entries in tables:
            near = [e for e in entries if e["shape"][1:] == shape[1:]]
            if near:
                return min(near, key=lambda e: abs(math.log(e["shape"][0] / shape[0])))["config"]
    return None


def save(path: Path, op: str, gpu: str, world, shape, config: dict) -> None:
    """Add or replace the entry for ``shape`` in the table at ``path``."""
    path = Path(path)
    table = _load(path) if path.exists() else {}
    table = json.loads(json.dumps(table))  # a private copy
    entries = table.setdefault(gpu, {}).setdefault(str(world), {}).setdefault(op, [])
    entries[:] = [e for e in entries if e["shape"] != list(shape)] + [{"shape": list(shape), "config": config}]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
