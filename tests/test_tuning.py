"""Tuned tables: which entry an op gets, and scripts/tune.py --tiles-only end to end on the host backend."""
import json
import os
import subprocess
import sys

import pytest

from refs import OfflineContext
from triton_overlap.ops import tuned as tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_lookup_prefers_world_size_then_any_then_nearest(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("TRITON_OVERLAP_TUNED", str(path))
    tuning.save(path, "ag_gemm", "GPU", "any", [8192, 4096, 4096], {"tag": "any-exact"})
    tuning.save(path, "ag_gemm", "GPU", 2, [8192, 4096, 4096], {"tag": "w2-exact"})
    tuning.save(path, "ag_gemm", "GPU", 2, [2048, 8192, 1024], {"tag": "w2-near"})
    tuning.save(path, "ag_gemm", "GPU", "any", [4096, 8192, 1024], {"tag": "any-near"})
    tuning.save(path, "ag_gemm", "GPU", "any", [2048, 8192, 512], {"tag": "any-exact-2"})
    assert tuning.lookup("ag_gemm", "GPU", 2, (8192, 4096, 4096))["tag"] == "w2-exact"
    assert tuning.lookup("ag_gemm", "GPU", 4, (8192, 4096, 4096))["tag"] == "any-exact"
    assert tuning.lookup("ag_gemm", "GPU", 2, (4096, 8192, 1024))["tag"] == "any-near"  # exact "any" before near w2
    assert tuning.lookup("ag_gemm", "GPU", 2, (16384, 8192, 1024))["tag"] == "w2-near"  # this world's, though farther
    assert tuning.lookup("ag_gemm", "GPU", 4, (16384, 8192, 1024))["tag"] == "any-near"
    assert tuning.lookup("ag_gemm", "GPU", 2, (2048, 8192, 512))["tag"] == "any-exact-2"
    assert tuning.lookup("ag_gemm", "GPU", 2, (2048, 1024, 512)) is None
    assert tuning.lookup("ag_gemm", "OTHER", 2, (8192, 4096, 4096)) is None
    assert tuning.lookup("gemm_rs", "GPU", 2, (8192, 4096, 4096)) is None
    saved = json.loads(path.read_text())
    assert len(saved["GPU"]["2"]["ag_gemm"]) == 2 and len(saved["GPU"]["any"]["ag_gemm"]) == 3


def test_the_shipped_table_is_read(tmp_path, monkeypatch):
    """The table inside the package is found, and an op's lookup reaches its entries (no user cache here)."""
    monkeypatch.setenv("TRITON_OVERLAP_TUNED", str(tmp_path / "none.json"))
    assert tuning.SHIPPED.is_file()
    table = json.loads(tuning.SHIPPED.read_text())
    gpu, by_world = next(iter(table.items()))
    op, entries = next(iter(by_world["any"].items()))
    shape = entries[0]["shape"]
    want = [e for e in entries if e["shape"] == shape][-1]["config"]
    assert tuning.lookup(op, gpu, 2, shape) == want


@pytest.mark.parametrize("op", ["gemm_rs", "ag_gemm_fp8"])
def test_tune_tiles_only_dry_run_writes_an_any_entry(tmp_path, op):
    out = tmp_path / "tuned.json"
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host", TRITON_OVERLAP_TUNED=str(out))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), os.path.join(ROOT, "scripts", "tune.py"),
                           op, "--shape", "64,32,48", "--tiles-only", "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "2 tile configs" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]  # both ran, checked
    table = json.loads(out.read_text())
    (entry,) = table["host"]["any"][op]
    assert entry["shape"] == [64, 32, 48]
    assert set(entry["config"]) == {"block_m", "block_n", "block_k", "num_warps", "num_stages", "tma"}  # tiles only


def test_tiles_only_entry_keeps_the_ops_other_defaults(tmp_path, monkeypatch):
    """An entry naming only the tiles changes only the tiles: chunking, launch order etc. stay the op's."""
    import triton_overlap as to

    path = tmp_path / "tuned.json"
    monkeypatch.setenv("TRITON_OVERLAP_TUNED", str(path))
    tiles = {"block_m": 64, "block_n": 64, "block_k": 16, "num_warps": 2, "num_stages": 2}
    tuning.save(path, "ag_gemm", "host", "any", [96, 48, 40], tiles)
    got = to.AllGatherGEMM(OfflineContext()).config_for((96, 48, 40))
    base = to.AllGatherGEMMConfig.defaults(OfflineContext())
    assert {k: getattr(got, k) for k in tiles} == tiles
    assert (got.chunks_per_rank, got.group_m, got.mode, got.consumer_first) == (base.chunks_per_rank, base.group_m,
                                                                               base.mode, base.consumer_first)
    assert to.AllGatherGEMM(OfflineContext()).config_for((96, 48, 24)) == base  # no entry for these trailing dims
    # fp8 calls read their own entries ("ag_gemm_fp8"), never the 16-bit ones, and the reverse
    assert to.AllGatherGEMM(OfflineContext()).config_for((96, 48, 40), "_fp8") == base.for_fp8(OfflineContext())
    fp8_tiles = dict(tiles, block_k=32)
    tuning.save(path, "ag_gemm_fp8", "host", "any", [96, 48, 40], fp8_tiles)
    op = to.AllGatherGEMM(OfflineContext())
    assert {k: getattr(op.config_for((96, 48, 40), "_fp8"), k) for k in tiles} == fp8_tiles
    assert {k: getattr(op.config_for((96, 48, 40)), k) for k in tiles} == tiles


def test_entries_of_older_tables_still_read(tmp_path, monkeypatch):
    """A table saved whole by an older tuner names ``gluon`` / ``warp_specialized`` (now ``gemm``) and fields that
    were None (``tma_store``, ``claim``): they read as the same choices."""
    import triton_overlap as to

    path = tmp_path / "tuned.json"
    monkeypatch.setenv("TRITON_OVERLAP_TUNED", str(path))
    old = {"block_m": 64, "tma_store": None, "claim": None, "gluon": False, "warp_specialized": None}
    tuning.save(path, "ag_gemm", "host", "any", [96, 48, 40], {k: v for k, v in old.items() if k != "claim"})
    tuning.save(path, "gemm_rs", "host", "any", [96, 48, 40], dict(old, gluon=None, warp_specialized=True))
    ag = to.AllGatherGEMM(OfflineContext()).config_for((96, 48, 40))
    assert (ag.block_m, ag.tma_store, ag.gemm) == (64, True, "triton")
    rs = to.GEMMReduceScatter(OfflineContext()).config_for((96, 48, 40))
    assert (rs.block_m, rs.claim, rs.gemm) == (64, 0, "gluon")


def test_tune_cp_attention_dry_run_checks_every_kernel(tmp_path):
    """scripts/tune.py cp_attention end to end on the host backend: every forward, dQ and dK/dV candidate runs and
    passes its check against torch, and the entry holds the three kernels' tiles."""
    out = tmp_path / "tuned.json"
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host", TRITON_OVERLAP_TUNED=str(out))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), os.path.join(ROOT, "scripts", "tune.py"),
                           "cp_attention", "--shape", "1,64,4,2,32,1", "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for stage in ("forward", "dq", "dkdv"):
        assert f"{stage} [2/2]" in proc.stdout, proc.stdout[-2000:]
    assert "skipped" not in proc.stdout, proc.stdout[-2000:]
    (entry,) = json.loads(out.read_text())["host"]["any"]["cp_attention"]
    assert entry["shape"] == [64, 4, 2, 32, 1]
    assert set(entry["config"]) == {"fwd", "dq", "dkdv"}


def test_moe_ops_read_their_own_entries_exact_then_nearest(tmp_path, monkeypatch):
    """The MoE ops look entries up at moe_table_shape (T, K, N, E, topk), each under its own name: the same shape,
    else the same K, N, E and topk with the nearest T (log scale); nothing for other K, N, E or topk."""
    import triton_overlap as to
    from triton_overlap.ops.moe_config import moe_table_shape

    path = tmp_path / "tuned.json"
    monkeypatch.setenv("TRITON_OVERLAP_TUNED", str(path))
    tuning.save(path, "ag_moe_gemm", "host", 2, [256, 32, 48, 8, 2], {"block_m": 32, "chunks_per_rank": 1})
    tuning.save(path, "ag_moe_gemm", "host", 2, [4096, 32, 48, 8, 2], {"block_m": 64})
    tuning.save(path, "moe_gemm_rs", "host", "any", [256, 32, 48, 8, 2], {"block_n": 64})
    base = to.MoEGEMMConfig.defaults(OfflineContext())

    def cfg(cls, *shape):
        return cls(OfflineContext()).config_for(moe_table_shape(*shape))

    exact = cfg(to.AllGatherMoEGEMM, 256, 32, 48, 8, 2)
    assert (exact.block_m, exact.chunks_per_rank, exact.block_n) == (32, 1, base.block_n)
    assert cfg(to.AllGatherMoEGEMM, 512, 32, 48, 8, 2).block_m == 32  # nearest T on a log scale
    assert cfg(to.AllGatherMoEGEMM, 2048, 32, 48, 8, 2).block_m == 64
    for other in ((256, 32, 48, 16, 2), (256, 32, 48, 8, 4), (256, 32, 64, 8, 2)):  # E, topk, N differ
        assert cfg(to.AllGatherMoEGEMM, *other) == base
    rs = cfg(to.MoEGEMMReduceScatter, 1024, 32, 48, 8, 2)  # its own ("any") entry, never ag_moe_gemm's
    assert (rs.block_m, rs.block_n) == (base.block_m, 64)


def _moe_configs_used(path, m_local, k, n, experts, topk):
    """On every rank: one call of each MoE op on the host backend with the tuned table at ``path``; the configs the
    calls used."""
    import torch

    import triton_overlap as to

    old = os.environ.get("TRITON_OVERLAP_TUNED")
    os.environ["TRITON_OVERLAP_TUNED"] = path
    try:
        with to.Context(timeout_s=120) as ctx:
            T = m_local * ctx.world_size
            x = torch.randn(m_local, k, dtype=torch.bfloat16)
            h = torch.randn(T, topk, k, dtype=torch.bfloat16)
            w = torch.randn(experts, k, n, dtype=torch.bfloat16)
            ids = torch.arange(T * topk).view(T, topk) % experts
            weights = torch.full((T, topk), 1.0 / topk)
            ag = to.AllGatherMoEGEMM(ctx, fallback="never")
            rs = to.MoEGEMMReduceScatter(ctx, fallback="never")
            ag(x, w, ids)
            rs(h, w, ids, weights)
            ctx.check()
            return ag.schedule(x, {}).cfg, rs.schedule(T, n, h.dtype, {}).cfg
    finally:
        if old is None:
            os.environ.pop("TRITON_OVERLAP_TUNED")
        else:
            os.environ["TRITON_OVERLAP_TUNED"] = old


def test_tune_moe_dry_run_writes_entries_the_ops_use(tmp_path):
    """scripts/tune.py moe end to end on the host backend: both ops' tile and chunking candidates run and pass
    their check against the torch fallback, each op's winner is stored at moe_table_shape under this world size,
    and the ops' next calls at that shape run with it."""
    import triton_overlap as to
    from harness import get_pool

    out = tmp_path / "tuned.json"
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host", TRITON_OVERLAP_TUNED=str(out))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), os.path.join(ROOT, "scripts", "tune.py"),
                           "moe", "--shape", "16,32,32,4,2,zipf", "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for stage in ("ag_moe_gemm tiles", "ag_moe_gemm chunking", "moe_gemm_rs tiles", "moe_gemm_rs chunking"):
        assert f"{stage} [2/2]" in proc.stdout, proc.stdout[-2000:]
    assert "skipped" not in proc.stdout, proc.stdout[-2000:]
    table = json.loads(out.read_text())["host"]["2"]
    used = get_pool("host", 2).run(_moe_configs_used, str(out), 16, 32, 32, 4, 2)
    for i, kind in enumerate(("ag_moe_gemm", "moe_gemm_rs")):
        (entry,) = table[kind]
        assert entry["shape"] == [32, 32, 32, 4, 2]  # T = 16 tokens per rank x 2 ranks
        want = to.MoEGEMMConfig(**entry["config"])
        assert want != to.MoEGEMMConfig.defaults(OfflineContext())  # explicit streams at least: not the defaults
        assert all(cfgs[i] == want for cfgs in used), (used, want)
