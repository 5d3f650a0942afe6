"""The AllReduce benchmarks' parts that run without GPUs (benchmarks/bench.py all_reduce and all_reduce_rmsnorm,
benchmarks/report.py, benchmarks/nccl_symm.py): the rows and reports they write, old records included; the
back-to-back columns' bookkeeping (with capture and timing stubbed); how NCCL's symmetric registration is found or
refused from what torch exposes; and the three AllReduce + RMSNorm paths agreeing on the host backend."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
bench = pytest.importorskip("bench")
report = pytest.importorskip("report")
nccl_symm = pytest.importorskip("nccl_symm")


def _columns(line: str) -> int:
    return line.count("|") - 1


def _ar_record(size=2048, **kw):
    rec = {"bytes": size, "numel": size // 2, "world_size": 2, "gpu": "H200", "note": "", "lead_us": 500.0,
           "latency_us": 4.0, "peer_bandwidth_gbs": 350.0, "bound_us": 4.0 + size / 350e3, "path": "overlap",
           "b2b_calls": 64}
    for k in ("ours", "one_shot", "two_shot", "nccl", "nccl_symm", "torch_one_shot", "torch_two_shot"):
        rec[f"{k}_us"] = rec[f"{k}_graph_us"] = 10.0
    rec.update(ours_b2b_us=4.0, one_shot_b2b_us=4.1, nccl_b2b_us=12.0, nccl_symm_b2b_us=6.0,
               torch_one_shot_b2b_us=8.0, torch_two_shot_b2b_us=9.0)
    rec.update(kw)
    return rec


def test_all_reduce_row_has_every_column_and_names_the_best_baseline():
    header = report.AR_HEADER.splitlines()[0]
    full = _ar_record()
    row = report.ar_row(full)
    assert _columns(row) == _columns(header) == 24
    assert row.rstrip().endswith("| 1.50x vs NCCL symm |"), row  # 6.0 / 4.0, the fastest of the four baselines
    # a baseline not measured is left out of the best; none measured, or ours not: n/a
    assert report.b2b_speedup(_ar_record(nccl_symm_b2b_us=None)) == "2.00x vs torch one-shot"
    assert report.b2b_speedup(_ar_record(ours_b2b_us=None)) == "n/a"
    none = _ar_record(**{k: None for k, _ in report.AR_B2B_BASELINES})
    assert report.best_baseline(none) is None and report.b2b_speedup(none) == "n/a"
    # ours handed to the process group is marked in the eager and the b2b column alike
    fallback = report.ar_row(_ar_record(8 << 20, path="fallback"))
    assert fallback.count("(NCCL)") == 2 and _columns(fallback) == 24
    # records written before the b2b and NCCL symm columns existed
    old = {k: v for k, v in _ar_record().items() if not (k.endswith("_b2b_us") or k.startswith("nccl_symm"))}
    line = report.ar_row(old)
    assert _columns(line) == 24 and line.rstrip().endswith("| n/a |"), line


def test_all_reduce_report_says_how_it_timed_and_keeps_the_notes(tmp_path):
    records = [_ar_record(2048), _ar_record(8192, nccl_symm_b2b_us=None, nccl_symm_us=None, nccl_symm_graph_us=None)]
    records[0]["note"] = "nccl_symm: torch 2.11.0, NCCL 2.28.3, NCCL env: none set; enabled: a pool; "
    records[1]["note"] = "nccl_symm: torch 2.11.0, NCCL 2.28.3; not enabled: no register_mem_pool; "
    report.write_all_reduce(records, 2, str(tmp_path), pending=[33554432])
    base = os.path.join(tmp_path, "all_reduce-H200x2")
    with open(base + ".md") as f:
        md = f.read()
    assert "b2b: 64 calls back to back in one CUDA graph" in md
    assert "- 2048 bytes: nccl_symm: torch 2.11.0" in md and "not enabled: no register_mem_pool" in md
    assert "Not measured in this run (it ended before them): 33554432." in md
    with open(base + ".json") as f:
        doc = json.load(f)
    assert doc["op"] == "all_reduce" and doc["records"][0]["ours_b2b_us"] == 4.0 and doc["not_measured"] == [33554432]


def _rms_record(M, H, ours_graph, nccl_graph, **kw):
    rec = {"M": M, "H": H, "dtype": "bfloat16", "eps": 1e-5, "world_size": 2, "gpu": "H200", "note": "",
           "lead_us": 500.0, "path": "overlap", "b2b_calls": 64, "rel_err": 3.1e-3,
           "ours_us": 12.0, "nccl_us": 30.0, "one_shot_us": 20.0,
           "ours_graph_us": ours_graph, "nccl_graph_us": nccl_graph, "one_shot_graph_us": 16.0,
           "ours_b2b_us": 5.0, "nccl_b2b_us": 20.0, "one_shot_b2b_us": 10.0}
    rec.update(kw)
    return rec


def test_all_reduce_rmsnorm_report_rows_and_speed_ups_against_the_target(tmp_path):
    records = [_rms_record(1, 4096, 10.0, 20.0), _rms_record(64, 8192, 10.0, 12.0, ours_b2b_us=None,
                                                             rel_err=None, note="ours_b2b_us: RuntimeError: x; ")]
    header = report.AR_RMSNORM_HEADER.splitlines()[0]
    rows = [report.ar_rmsnorm_row(r) for r in records]
    assert all(_columns(r) == _columns(header) == 17 for r in rows)
    assert "| 2.00x | 1.60x |" in rows[0] and rows[0].rstrip().endswith("| 4.00x | 2.00x | 3.1e-03 |"), rows[0]
    assert rows[1].rstrip().endswith("| n/a | n/a | n/a |"), rows[1]
    report.write_all_reduce_rmsnorm(records, 2, str(tmp_path), pending=[(16, 8192)])
    base = os.path.join(tmp_path, "all_reduce_rmsnorm-H200x2")
    with open(base + ".md") as f:
        md = f.read()
    geo = (2.0 * 1.2) ** 0.5
    assert (f"speed-up over NCCL + add + RMSNorm, graphs: geometric mean {geo:.2f}x, lowest 1.20x (M=64, H=8192), "
            "1 of 2 shapes at or above the target 1.5x") in md, md
    assert "speed-up over NCCL + add + RMSNorm, back to back: geometric mean 4.00x, lowest 4.00x (M=1, H=4096)" in md
    assert "b2b: 64 calls back to back in one CUDA graph" in md and "eps 1e-05" in md
    assert "- M=64 H=8192: ours_b2b_us: RuntimeError" in md
    assert "Not measured in this run (it ended before them): 16,8192." in md
    with open(base + ".json") as f:
        doc = json.load(f)
    assert doc["op"] == "all_reduce_rmsnorm" and doc["not_measured"] == [[16, 8192]] and len(doc["records"]) == 2
    assert report.speedup_summary([_rms_record(1, 4096, None, 20.0)], "nccl_graph_us", "ours_graph_us", "x") == ""


def test_all_reduce_rmsnorm_is_a_benchmark_with_the_issues_shapes():
    assert bench.AR_RMSNORM_SHAPES == [(m, h) for h in (4096, 8192) for m in (1, 4, 16, 64)]
    import subprocess

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "all_reduce_rmsnorm" in out and "--b2b-calls" in out


class _Ctx:
    def check(self):
        pass


class _Graph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def test_back_to_back_columns_bookkeeping(monkeypatch):
    """time_back_to_back with capture and timing stubbed: each column captures ``calls`` calls, its time is the
    replay's over ``calls``; a column that calls a gloo group is not captured, a failing capture leaves None and a
    note, and a failure timing in turns times the others one at a time."""
    calls = {"ours": 0, "nccl": 0}

    def count(k):
        def fn():
            calls[k] += 1
        return fn

    def boom():
        raise RuntimeError("capture failed\nsecond line")

    monkeypatch.setattr(bench, "capture", lambda fn: (fn(), _Graph(fn))[1])  # one eager run, as timing.capture
    monkeypatch.setattr(bench, "time_interleaved", lambda fns, iters, **kw: {k: 640.0 for k in fns})
    monkeypatch.setattr(bench, "group_capturable", lambda: True)
    rec = {"note": "", "path": "overlap"}
    bench.time_back_to_back(_Ctx(), rec, {"ours_us": count("ours"), "nccl_us": count("nccl"), "torch_one_shot_us": None,
                                          "one_shot_us": boom}, iters=5, calls=8)
    assert calls == {"ours": 8, "nccl": 8} and rec["b2b_calls"] == 8
    assert rec["ours_b2b_us"] == rec["nccl_b2b_us"] == 80.0
    assert rec["torch_one_shot_b2b_us"] is None and rec["one_shot_b2b_us"] is None
    assert rec["note"] == "one_shot_b2b_us: RuntimeError: capture failed; "

    monkeypatch.setattr(bench, "group_capturable", lambda: False)  # gloo: NCCL and ours through the group skipped
    rec = {"note": "", "path": "fallback"}
    bench.time_back_to_back(_Ctx(), rec, {"ours_us": count("ours"), "nccl_symm_us": count("nccl"),
                                          "torch_two_shot_us": count("ours")}, iters=5, calls=4)
    assert rec["ours_b2b_us"] is None and rec["nccl_symm_b2b_us"] is None and rec["torch_two_shot_b2b_us"] == 160.0
    assert "ours_b2b_us: not captured (the process group is gloo)" in rec["note"]
    assert "nccl_symm_b2b_us: not captured" in rec["note"]

    def fails(fns, iters, **kw):
        raise RuntimeError("a replay failed")

    monkeypatch.setattr(bench, "time_interleaved", fails)
    monkeypatch.setattr(bench, "timed", lambda fn, iters, **kw: 320.0)
    rec = {"note": "", "path": "overlap"}
    bench.time_back_to_back(_Ctx(), rec, {"ours_us": count("ours")}, iters=5, calls=4)
    assert rec["ours_b2b_us"] == 80.0 and "b2b in turns: RuntimeError: a replay failed" in rec["note"]


def _doc(signature):
    return f"{signature}\n\nRegister a memory pool.\n"


def _backend(doc, allocator=True):
    class Backend:
        def register_mem_pool(self, *args, **kwargs):
            pass

    Backend.register_mem_pool.__doc__ = doc
    Backend.__name__ = "ProcessGroupNCCL"
    if allocator:
        Backend.mem_allocator = object()
    return Backend()


class _MemPool:
    def __init__(self, allocator=None, use_on_oom=False):
        pass


class _SymmetricMemPool:
    def __init__(self, allocator=None, symmetric=False):
        pass


def test_nccl_symmetric_route_follows_what_torch_exposes(monkeypatch):
    keyword = "register_mem_pool(self: ProcessGroupNCCL, pool: torch._C._MemPool, symm: bool = False) -> None"
    positional = "register_mem_pool(self: ProcessGroupNCCL, arg0: torch._C._MemPool, arg1: bool) -> None"
    plain = "register_mem_pool(self: ProcessGroupNCCL, arg0: torch._C._MemPool) -> None"
    v = (2, 28, 3)
    # pybind11 methods have no signature inspect can read (ValueError): their docstring names the parameters
    monkeypatch.setattr(nccl_symm.inspect, "signature", lambda fn: (_ for _ in ()).throw(ValueError("pybind")))

    r, why = nccl_symm.route(_backend(_doc(keyword)), _MemPool, v)
    assert why is None and r.register_kwargs == {"symm": True} and not r.register_args and not r.pool_kwargs
    assert "register_mem_pool(pool, symm=True)" in r.text and "ProcessGroupNCCL.mem_allocator" in r.text
    r, why = nccl_symm.route(_backend(_doc(positional)), _MemPool, v)
    assert why is None and r.register_args == (True,) and not r.register_kwargs
    monkeypatch.undo()  # the MemPool stand-ins are plain Python: their signatures are read by inspect
    r, why = nccl_symm.route(_backend(_doc(plain)), _SymmetricMemPool, v)
    assert why is None and r.pool_kwargs == {"symmetric": True} and not r.register_args and not r.register_kwargs

    for backend, pool, version, words in (
            (None, _MemPool, v, "no CUDA backend"),
            (_backend(_doc(keyword)), _MemPool, None, "no NCCL"),
            (_backend(_doc(keyword)), _MemPool, (2, 26, 5), "NCCL 2.26.5 has no symmetric kernels"),
            (_backend(_doc(keyword), allocator=False), _MemPool, v, "has no mem_allocator"),
            (object(), _MemPool, v, "has no mem_allocator"),
            (_backend(_doc(plain)), _MemPool, v, "takes no symmetric flag")):
        r, why = nccl_symm.route(backend, pool, version)
        assert r is None and words in why, (words, why)

    # this torch, whatever it is: an answer either way, never an exception
    r, why = nccl_symm.route(None, getattr(torch.cuda, "MemPool", None), nccl_symm.nccl_version())
    assert r is None and why
    assert nccl_symm.version_text((2, 28, 3)) == "2.28.3" and nccl_symm.version_text(None) == "none"
    assert nccl_symm.is_nccl_kernel("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16")
    assert nccl_symm.is_symmetric_kernel("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16")  # NCCL 2.28
    assert nccl_symm.is_symmetric_kernel("ncclSymDevKernel_AllReduce_AGxLL_R_sum_bf16")  # NCCL 2.27
    assert not nccl_symm.is_symmetric_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL")
    assert nccl_symm.is_nccl_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert not nccl_symm.is_nccl_kernel("nccl:all_reduce")


def test_symmetric_buffer_on_gloo_says_why_not():
    buf = nccl_symm.SymmetricBuffer(None, 1024, torch.bfloat16, torch.device("cpu"), "gloo")
    assert buf.tensor is None and buf.view(8) is None
    assert "not enabled: the process group is gloo, not NCCL" in buf.describe()
    assert f"torch {torch.__version__}" in buf.describe()
    buf.close()


def _rmsnorm_paths_agree():
    """The benchmark's three AllReduce + RMSNorm paths on the host backend (float32: gloo sums no bf16), each
    against float64, and ours against the NCCL path, as the benchmark records them."""
    import triton_overlap as to
    from refs import rand

    with to.Context(timeout_s=60) as ctx:
        dev, M, H = ctx.device, 3, 40
        x = rand((M, H), torch.float32, dev, "bench-arn-x", ctx.rank)
        residual = rand((M, H), torch.float32, dev, "bench-arn-r")
        weight = rand((H,), torch.float32, dev, "bench-arn-w")
        fused = to.AllReduceRMSNorm(ctx, fallback="never")
        one_shot = to.AllReduce(ctx, algorithm="one_shot", fallback="never", name="bench.one_shot")
        buf = x.clone()
        paths = bench.rmsnorm_paths(x, residual, weight, 1e-5, fused, one_shot, buf)
        rec = bench.rmsnorm_errors(x, residual, weight, 1e-5, paths, buf)
        ctx.check()
        assert fused.last_path == "overlap" and one_shot.last_path == "overlap"
        assert set(rec) == {"rel_err", "residual_rel_err", "ours_rel_err_fp64", "nccl_rel_err_fp64",
                            "one_shot_rel_err_fp64"}, rec
        assert max(rec.values()) < 1e-5, rec
        return rec


def test_rmsnorm_paths_agree_on_the_host_backend(pool):
    if pool.backend != "host" or pool.world != 2:
        pytest.skip("host backend, W = 2: the benchmark itself runs on GPUs")
    pool.run(_rmsnorm_paths_agree)
