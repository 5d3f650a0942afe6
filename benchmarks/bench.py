"""Side-by-side benchmarks of the overlapped ops, one sub-command per op.

    bash scripts/launch.sh benchmarks/bench.py ag_gemm|ag_gemm_fp8|gemm_rs|cp_attention|all_reduce|
        all_reduce_rmsnorm|gemm_ar|moe|ep|ep_ll|model [--shapes ...] [--out DIR] [--shared-gpu] [--virtual-hosts N]

For every shape, in one process group and one run: ours; NCCL + cuBLAS (sequential); torch's fused symm_mem op;
the bound (torch.matmul of the same work alone); our consumer GEMM alone (the kernel the op ran, named in the
JSON's ``consumer``). Attention: ours; NCCL all_gather of K/V then our kernel; torch's SDPA on the full
sequence on one GPU; our kernel alone. AllReduce: ours, NCCL, NCCL on a buffer registered for its symmetric
kernels (nccl_symm.py, where torch and NCCL allow it), torch's symmetric-memory all-reduces, the bound; also
``--b2b-calls`` calls back to back in one CUDA graph, the replay's time per call (``*_b2b_us``). AllReduce +
residual + RMSNorm: ours fused against NCCL all_reduce + add + RMSNorm and our one-shot AllReduce + add + RMSNorm,
eager, in graphs and back to back. GEMM + AllReduce: ours, torch.matmul + NCCL, the GEMM alone. MoE (moe.py):
the MoE ops and layer against NCCL + sort + torch._grouped_mm, and the grouped GEMM alone. Expert parallel (ep.py):
dispatch, combine and the EPMoE layer against the same exchange through all_to_all_single; ep_ll
(ep_low_latency.py): the low-latency mode in CUDA graphs at decode sizes. Model (model.py): a
training and a decode step of Llama-shaped layers, ours against torch TP, async TP and our fallback. Distributed
timings: CUDA events around each call, ranks aligned on the device before each iteration, median over iterations,
max over ranks (triton_overlap.timing); the headline columns timed in turns within each iteration, so all see the
same GPU clock. ``--virtual-hosts N`` splits the ranks into N hosts (TRITON_OVERLAP_VIRTUAL_HOSTS): ours then moves
data between them through the process group (NCCL), as between machines, and the files gain ``-<N>hosts``. Writes
``<op>-<gpu>x<W>.{json,md,png}`` (report.py) into ``--out`` (default ``bench-results/``; the committed results are
``benchmarks/results/``). GPUs only.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import triton_overlap as to
from report import (AR_HEADER, AR_RMSNORM_HEADER, CP_HEADER, GEMM_AR_HEADER, HEADER, _cp_row, _row, ar_rmsnorm_row,
                    ar_row, gemm_ar_row, write, write_all_reduce, write_all_reduce_rmsnorm, write_cp, write_gemm_ar)
from triton_overlap.context.collectives import all_gather_rows, reduce_scatter_rows
from triton_overlap.kernels.gemm import plain_gemm
from triton_overlap.kernels.gemm_gather_hopper import plain_gemm_hopper
from triton_overlap.kernels.gemm_warp_specialized import plain_gemm_ws
from triton_overlap.ops.gemm_reduce_scatter import scatter_mode, sums_in_host
from triton_overlap.timing import capture, host_us, profile_to, spin, time_dist, time_interleaved
from triton_overlap.torchrun import init, say

AG_SHAPES = [(2048, 4096, 4096), (8192, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 14336), (8192, 8192, 3584),
             (4096, 8192, 1792)]
RS_SHAPES = [(2048, 4096, 4096), (8192, 4096, 4096), (8192, 8192, 8192), (16384, 7168, 8192), (8192, 1792, 8192)]
#: µs the stream spins before and after the all_reduce that lines the ranks up before each timed call
#: (timing.time_dist's lead_us): the host has enqueued the call by then and every rank starts it together, as in
#: a model whose host runs ahead. 0 (--lead-us 0): the GPU idles until the host has enqueued, and each rank
#: starts when its own host is done (kept as *_idle_us for ours and NCCL).
LEAD_US = 500.0


def timed(fn, iters: int, **kw) -> float:
    """time_dist with the benchmark's lead (LEAD_US)."""
    return time_dist(fn, iters, lead_us=LEAD_US, **kw)


def time_local(fn) -> float:
    """A single-GPU timing (bound, consumer alone, SDPA), taken exactly like ours: one call per iteration between
    events, the ranks aligned before each (time_dist), so that the bound and ours are measured alike
    (docs/decisions.md)."""
    return timed(fn, 30, budget_s=2.0)


def time_gemm(rec, key, fn) -> None:
    """``rec[key]``: a GEMM alone on one GPU (the bound, our consumer alone), timed as a CUDA-graph replay like
    ours (an eager call of ours replays the op's graph): GPU time without the host's launch cost, which an
    overlapped call does not pay either. The eager timing (time_local) is kept as ``<key minus _us>_eager_us``."""
    eager = key.replace("_us", "_eager_us")
    rec[eager] = time_local(fn)
    rec[key], note = try_time(capture(fn).replay, 30)
    if note:
        rec["note"] += f"{key}: {note}; "
        rec[key] = rec[eager]


def group_capturable() -> bool:
    """Whether calls into the process group can be captured in CUDA graphs: not over gloo (--shared-gpu), where a
    failed capture leaves torch's allocator unusable. Across hosts ours calls the process group as well."""
    return dist.get_backend() == "nccl"


def time_graphs(rec, ours, nccl, iters):
    """ours_graph_us and nccl_graph_us: both captured in CUDA graphs, so the launch cost of Python drops out."""
    for key, fn in (("ours_graph_us", ours), ("nccl_graph_us", nccl)):
        if not group_capturable():
            rec[key] = None
            rec["note"] += f"{key}: not captured (the process group is gloo); "
            continue
        rec[key], note = try_time(capture(fn).replay, iters)
        if note:
            rec["note"] += f"{key}: {note}; "


def time_variant(ctx, rec, name, fn, iters):
    """``<name>_us`` (eager) and ``<name>_graph_us`` (CUDA-graph replay) of ``fn``; a failure, or a wait that
    timed out (ctx.check), is recorded in the note and leaves None, and the benchmark goes on."""
    rec[f"{name}_us"] = rec[f"{name}_graph_us"] = None
    try:
        rec[f"{name}_us"] = timed(fn, iters)
        ctx.check()
        if ctx.num_hosts > 1 and not group_capturable():
            return
        rec[f"{name}_graph_us"] = timed(capture(fn).replay, iters)
        ctx.check()
    except Exception as e:  # noqa: BLE001 - recorded in the note
        rec["note"] += f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "


def time_weight_t(rec, ours, nccl, bound, consumer, iters):
    """The same call with B stored as [N, K] and passed as its transpose (nn.Linear's ``weight.t()``): ours as a
    user gets it, NCCL + cuBLAS, cuBLAS alone and our GEMM alone (``*_wt_us``)."""
    rec["ours_wt_us"] = timed(ours, iters)
    rec["nccl_wt_us"] = timed(nccl, iters)
    time_gemm(rec, "bound_wt_us", bound)
    time_gemm(rec, "consumer_only_wt_us", consumer)


def try_time(fn, iters):
    try:
        return timed(fn, iters), None
    except Exception as e:  # noqa: BLE001 - recorded as the baseline's note
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def side_by_side(ctx, rec, fns, iters, budget_s=None):
    """The headline columns (``fns``: {key: fn}) timed again in turns within each iteration
    (timing.time_interleaved), so that ours and every baseline see the same GPU clock. These replace the values
    timed one after another earlier in the run, which stay as ``<key minus _us>_seq_us``. A key whose earlier
    timing failed (None) is left out."""
    fns = {k: f for k, f in fns.items() if f is not None and rec.get(k) is not None}
    for k in fns:
        rec[k[:-3] + "_seq_us"] = rec[k]
    rec.update(time_interleaved(fns, iters, budget_s=budget_s, lead_us=LEAD_US))
    ctx.check()


def gemm_graph(fn):
    """A single-GPU GEMM's graph replay (how time_gemm times the bound and our GEMM alone)."""
    return capture(fn).replay


def enable_symm_mem():
    """Turn on torch's symmetric memory for the world group (its fused ops need it): None, or why not."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
        return None
    except Exception as e:  # noqa: BLE001 - recorded as the fused op's note
        return f"symm_mem unavailable: {e}"


def time_ours(ctx, rec, op, auto, plain, call, iters):
    """Ours three ways, ``call(o)`` calling op ``o``: overlap forced without replay (``op``), as a user gets it
    (``auto``: fallback="auto", replay on; with its path and replay counts), and without replay (``plain``);
    then the host cost of a replayed call. The two without replay are timed with the GPU idle before each
    call (their point is the host's cost); ours also so, as ``ours_idle_us``."""
    rec["ours_overlap_us"] = time_dist(lambda: call(op), iters)
    rec["ours_us"], rec["path"] = timed(lambda: call(auto), iters), auto.last_path
    rec["replay_stats"] = dict(auto.replays.stats)
    rec["ours_idle_us"] = time_dist(lambda: call(auto), iters)
    rec["ours_no_replay_us"], rec["no_replay_path"] = time_dist(lambda: call(plain), iters), plain.last_path
    ctx.check()
    rec["host_replay_us"] = host_us(lambda: call(auto))
    rec["host_replay_path"] = auto.last_path


def gpu_name() -> str:
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "_")


def ag_consumer(ctx, op, gathered, w, c):
    """AllGather-GEMM's consumer alone, ``c = gathered @ w`` on one GPU: the GEMM kernel the op's last call ran
    (op.last_gemm), the Gluon one or kernels.gemm's with the op's tiles."""
    if op.last_gemm == "gemm_gather_hopper":
        return plain_gemm_hopper(ctx, gathered, w, c)
    return plain_gemm(ctx, op.config_for((gathered.shape[0], gathered.shape[1], w.shape[1])), gathered, w, c)


def bench_ag_gemm(ctx, shapes, iters, write_partial):
    W = ctx.world_size
    records = []
    fused_ok = enable_symm_mem()
    op = to.AllGatherGEMM(ctx, fallback="never", replay=False)  # the overlap, enqueued anew every call
    auto = to.AllGatherGEMM(ctx, name="ag_gemm.auto")  # what a user gets: fallback="auto", replay on
    plain = to.AllGatherGEMM(ctx, name="ag_gemm.plain", replay=False)  # fallback="auto", no replay
    for M, K, N in shapes:
        torch.manual_seed(ctx.rank)
        a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        rec = {"M": M, "K": K, "N": N, "world_size": W, "gpu": gpu_name(), "note": "", "lead_us": LEAD_US}

        time_ours(ctx, rec, op, auto, plain, lambda o: o(a, w, out=out), iters)
        rec["ours_consumer_first_us"] = timed(lambda: op(a, w, out=out, consumer_first=True), iters)
        ctx.check()
        rec["host_enqueue_us"] = host_us(lambda: op(a, w, out=out))
        ref_full = torch.cat([t for t in _gather(a)]).float() if M * K <= (1 << 26) else None
        if ref_full is not None:  # a correctness spot check on the benchmarked shape
            err = float(((out.float() - ref_full @ w.float()).norm() / (ref_full @ w.float()).norm()).item())
            rec["rel_err"] = err

        def nccl():
            all_gather_rows(gathered, a)
            torch.matmul(gathered, w, out=out)

        rec["nccl_us"] = timed(nccl, iters)
        rec["nccl_idle_us"] = time_dist(nccl, iters)
        time_graphs(rec, lambda: op(a, w, out=out), nccl, iters)
        ctx.check()
        if fused_ok is None:
            rec["torch_fused_us"], note = try_time(
                lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [w], 0, dist.group.WORLD.group_name), iters)
        else:
            rec["torch_fused_us"], note = None, fused_ok
        if note:
            rec["note"] += f"torch fused: {note}; "
        all_gather_rows(gathered, a)
        time_gemm(rec, "bound_us", lambda: torch.matmul(gathered, w, out=out))
        time_gemm(rec, "consumer_only_us", ag_consumer(ctx, op, gathered, w, out))
        rec["consumer"] = op.last_gemm
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()  # B as nn.Linear's weight.t()

        def nccl_wt():
            all_gather_rows(gathered, a)
            torch.matmul(gathered, wt, out=out)

        time_weight_t(rec, lambda: auto(a, wt, out=out), nccl_wt, lambda: torch.matmul(gathered, wt, out=out),
                      ag_consumer(ctx, op, gathered, wt, out), iters)
        fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [w], 0, dist.group.WORLD.group_name)  # noqa: E731
        side_by_side(ctx, rec, {"ours_us": lambda: auto(a, w, out=out), "nccl_us": nccl, "torch_fused_us": fused,
                                "bound_us": gemm_graph(lambda: torch.matmul(gathered, w, out=out)),
                                "consumer_only_us": gemm_graph(ag_consumer(ctx, op, gathered, w, out))}, iters)
        records.append(rec)
        write_partial(records)  # keep what is measured if the variant below fails
        time_variant(ctx, rec, "ours_pull", lambda: op(a, w, out=out, mode="pull"), iters)  # ranks read peers' rows
        write_partial(records)
        say(_row(rec))
    return records


def bench_ag_gemm_fp8(ctx, shapes, iters, write_partial):
    """fp8 (e4m3) AllGather-GEMM with per-tensor scales and bf16 output; B stored [N, K] and passed as its
    transpose (how fp8 weights are kept, and the layout torch._scaled_mm takes). Ours (replay on, as a user
    gets it; no replay; overlap forced); NCCL all_gather + torch._scaled_mm; torch's
    fused_all_gather_scaled_matmul; the bound (torch._scaled_mm on the gathered shape alone, graph-timed); our
    GEMM alone. Every _scaled_mm with use_fast_accum=False, the precision our kernel has."""
    W = ctx.world_size
    f8, bf16, u8 = torch.float8_e4m3fn, torch.bfloat16, torch.uint8
    records = []
    group = dist.group.WORLD.group_name
    fused_ok = enable_symm_mem()
    op = to.AllGatherGEMM(ctx, fallback="never", replay=False, name="ag8")
    auto = to.AllGatherGEMM(ctx, name="ag8.auto")
    plain = to.AllGatherGEMM(ctx, name="ag8.plain", replay=False)
    for M, K, N in shapes:
        torch.manual_seed(ctx.rank)
        a = torch.randn(M // W, K, device="cuda").to(f8)
        wt = torch.randn(N, K, device="cuda").to(f8).t()
        sa, sb = torch.full((1,), 0.05, device="cuda"), torch.full((1,), 0.02, device="cuda")
        out = torch.empty(M, N, device="cuda", dtype=bf16)
        gathered = torch.empty(M, K, device="cuda", dtype=f8)
        kw = dict(out=out, scale_a=sa, scale_b=sb)
        rec = {"M": M, "K": K, "N": N, "world_size": W, "gpu": gpu_name(), "dtype": "float8_e4m3fn", "note": "",
               "lead_us": LEAD_US, "config": repr(op.config_for((M, K, N), "_fp8"))}
        time_ours(ctx, rec, op, auto, plain, lambda o: o(a, wt, **kw), iters)
        rec["host_enqueue_us"] = host_us(lambda: op(a, wt, **kw))
        all_gather_rows(gathered.view(u8), a.view(u8))
        if M * K <= (1 << 26):  # a correctness spot check on the benchmarked shape
            op(a, wt, **kw)
            ref = (gathered.float() @ wt.float()) * sa * sb
            rec["rel_err"] = float(((out.float() - ref).norm() / ref.norm()).item())

        def scaled_mm():
            torch._scaled_mm(gathered, wt, sa, sb, out_dtype=bf16, out=out)

        def nccl():
            all_gather_rows(gathered.view(u8), a.view(u8))
            scaled_mm()

        rec["nccl_us"] = timed(nccl, iters)
        rec["nccl_idle_us"] = time_dist(nccl, iters)
        time_graphs(rec, lambda: op(a, wt, **kw), nccl, iters)
        ctx.check()
        if fused_ok is None:
            rec["torch_fused_us"], note = try_time(lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                a, [wt], sa, [sb], 0, group, [None], [None], [bf16], [False]), iters)
        else:
            rec["torch_fused_us"], note = None, fused_ok
        if note:
            rec["note"] += f"torch fused: {note}; "
        all_gather_rows(gathered.view(u8), a.view(u8))
        time_gemm(rec, "bound_us", scaled_mm)
        time_gemm(rec, "consumer_only_us", plain_gemm(ctx, op.config_for((M, K, N), "_fp8"), gathered, wt, out,
                                                      scales=(sa, sb)))
        side_by_side(ctx, rec, {
            "ours_us": lambda: auto(a, wt, **kw), "nccl_us": nccl,
            "torch_fused_us": lambda: torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                a, [wt], sa, [sb], 0, group, [None], [None], [bf16], [False]),
            "bound_us": gemm_graph(scaled_mm),
            "consumer_only_us": gemm_graph(plain_gemm(ctx, op.config_for((M, K, N), "_fp8"), gathered, wt, out,
                                                      scales=(sa, sb)))}, iters)
        flop = 2 * M * K * N
        rec["bound_tflops"] = flop / rec["bound_us"] / 1e6
        rec["consumer_tflops"] = flop / rec["consumer_only_us"] / 1e6
        records.append(rec)
        write_partial(records)
        say(_row(rec))
    return records


def rs_consumer(ctx, op, a, w, c):
    """GEMM-RS's consumer alone, ``c = a @ w`` on one GPU: the GEMM kernel the op's last call ran (op.last_gemm),
    the warp-specialized one or kernels.gemm's with the op's tiles."""
    if op.last_gemm == "gemm_warp_specialized":
        return plain_gemm_ws(ctx, a, w, c)
    return plain_gemm(ctx, op.config_for((a.shape[0], a.shape[1], w.shape[1])), a, w, c)


def bench_gemm_rs(ctx, shapes, iters, write_partial):
    W = ctx.world_size
    records = []
    import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)  # the overlap, enqueued anew every call
    auto = to.GEMMReduceScatter(ctx, name="gemm_rs.auto")  # what a user gets: fallback="auto", replay on
    plain = to.GEMMReduceScatter(ctx, name="gemm_rs.plain", replay=False)  # fallback="auto", no replay
    group = dist.group.WORLD.group_name
    for M, K, N in shapes:
        torch.manual_seed(ctx.rank)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        full = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        rec = {"M": M, "K": K, "N": N, "world_size": W, "gpu": gpu_name(), "note": "", "lead_us": LEAD_US}
        time_ours(ctx, rec, op, auto, plain, lambda o: o(a, w, out=out), iters)
        rec["host_enqueue_us"] = host_us(lambda: op(a, w, out=out))
        if M * N <= (1 << 26):  # a correctness spot check on the benchmarked shape
            ref = (a.float() @ w.float())
            dist.all_reduce(ref)
            ref = ref[ctx.rank * (M // W):(ctx.rank + 1) * (M // W)]
            rec["rel_err"] = float(((out.float() - ref).norm() / ref.norm()).item())

        def nccl():
            torch.matmul(a, w, out=full)
            reduce_scatter_rows(out, full)

        rec["nccl_us"] = timed(nccl, iters)
        rec["nccl_idle_us"] = time_dist(nccl, iters)
        time_graphs(rec, lambda: op(a, w, out=out), nccl, iters)
        rec["torch_fused_us"], note = try_time(
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group), iters)
        if note:
            rec["note"] += f"torch fused: {note}; "
        ctx.check()
        time_gemm(rec, "bound_us", lambda: torch.matmul(a, w, out=full))
        time_gemm(rec, "consumer_only_us", rs_consumer(ctx, op, a, w, full))
        wt = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()  # B as nn.Linear's weight.t()

        def nccl_wt():
            torch.matmul(a, wt, out=full)
            reduce_scatter_rows(out, full)

        time_weight_t(rec, lambda: auto(a, wt, out=out), nccl_wt, lambda: torch.matmul(a, wt, out=full),
                      rs_consumer(ctx, op, a, wt, full), iters)
        side_by_side(ctx, rec, {
            "ours_us": lambda: auto(a, w, out=out), "nccl_us": nccl,
            "torch_fused_us": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group),
            "bound_us": gemm_graph(lambda: torch.matmul(a, w, out=full)),
            "consumer_only_us": gemm_graph(rs_consumer(ctx, op, a, w, full))}, iters)
        rec["consumer"] = op.last_gemm
        records.append(rec)
        rec["scatter"] = scatter_mode(op.config_for((M, K, N)), M, N, a.element_size(), ctx.copy_engines, W)
        other = "store" if rec["scatter"] == "copy" else "copy"  # the scatter "auto" did not pick, as the variant
        write_partial(records)
        if sums_in_host(ctx, op.config_for((M, K, N))):  # across hosts (always copy): partials crossing directly
            time_variant(ctx, rec, "ours_direct", lambda: op(a, w, out=out, reduce_in_host=False), iters)
        else:
            time_variant(ctx, rec, f"ours_{other}", lambda: op(a, w, out=out, scatter=other), iters)
        write_partial(records)
        say(_row(rec))
    return records


CP_SHAPES = [(1, 16384, 32, 8, 128, True), (1, 32768, 32, 8, 128, True), (1, 65536, 32, 8, 128, True),
             (1, 131072, 32, 8, 128, True), (1, 32768, 32, 8, 128, False),
             (1, 32768, 32, 8, 128, True, 12), (1, 131072, 32, 8, 128, True, 24)]  # the last field: packed documents
#: one GPU (-n 1): our kernel against SDPA's cuDNN and flash backends; GQA 4:1 and MQA, D = 128 and 64, bf16 and fp16
CP_SHAPES_ONE_GPU = [(1, 8192, 32, 8, 128, True), (1, 16384, 32, 8, 128, True), (1, 32768, 32, 8, 128, True),
                     (1, 16384, 32, 8, 128, False), (1, 16384, 32, 8, 64, True), (1, 16384, 32, 1, 128, True),
                     (1, 16384, 32, 8, 128, True, "fp16"), (1, 16384, 32, 8, 64, True, "fp16")]
CP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def local_docs(cu, world):
    """A shard's document boundaries as global ones of a world of one (each shard's documents are whole
    documents to the kernel run alone on it)."""
    return None if cu is None else list(to.zigzag.local_cu_seqlens(cu, world))


def doc_lengths(S: int, n: int, world: int, seed: int = 0) -> list[int]:
    """``n`` document lengths summing to ``S``, each a multiple of 2 * ``world``, drawn log-normally (seeded:
    every rank and every run draws the same), as packed pre-training batches hold them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(n, generator=g))
    unit = 2 * world
    lengths = [max(1, int(x)) * unit for x in (w / w.sum() * (S // unit)).tolist()]
    lengths[-1] += S - sum(lengths)  # the rest to the last document
    if lengths[-1] <= 0:
        raise ValueError(f"doc_lengths: {n} documents of at least {unit} tokens do not fit in {S}")
    return lengths


def varlen_sdpa(qt, kt, vt, cu, causal):
    """torch's flash varlen attention (torch.nn.attention.varlen, torch >= 2.10) on packed [T, H, D] q, k, v
    with boundaries ``cu``; K/V heads expanded where the function takes no GQA. None where it is missing."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    g = 1
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:  # expanded inside the call, so that a backward through it can run again
        g = qt.shape[1] // kt.shape[1]
    if "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        kw["window_size"] = (-1, 0)  # every key up to the query's own position
    cu_t = torch.tensor(cu, dtype=torch.int32, device=qt.device)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    expand = (lambda t: t) if g == 1 else (lambda t: t.repeat_interleave(g, dim=1))  # noqa: E731
    return lambda: varlen_attn(qt, expand(kt), expand(vt), cu_t, cu_t, longest, longest, **kw)
CP_BUDGET_S = 1.5  # per timed variant: large shapes take fewer iterations


def cudnn_sdpa(qt, kt, vt, causal):
    """SDPA's cuDNN backend on the full sequence (``[B, H, S, D]``): (forward, forward + backward, note), each None
    where the backend refuses the shape (the note says why). Where it does not take ``enable_gqa``, K/V heads are
    expanded to the query heads first (outside the timed call; the note says so)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    note = ""

    def make(k, v, gqa):
        leaves = [t.detach().requires_grad_() for t in (qt, k, v)]
        dout = torch.randn_like(qt)

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(qt, k, v, is_causal=causal, enable_gqa=gqa)

        def fwd_bwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sdpa(*leaves, is_causal=causal, enable_gqa=gqa).backward(dout)

        return fwd, fwd_bwd

    candidates = [(kt, vt, True)]
    if qt.shape[1] != kt.shape[1]:
        rep = qt.shape[1] // kt.shape[1]
        candidates.append((kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1), False))
    for k, v, gqa in candidates:
        fwd, fwd_bwd = make(k, v, gqa)
        try:
            fwd()
            fwd_bwd()
            torch.cuda.synchronize()
            return fwd, fwd_bwd, note
        except Exception as e:  # noqa: BLE001 - the next candidate, or recorded in the note
            note += f"cuDNN{' with enable_gqa' if gqa else ''}: {type(e).__name__}: {str(e).splitlines()[0][:120]}; "
    return None, None, note


def bench_cp_attention(ctx, shapes, iters, write_partial):
    """ours; NCCL all_gather of K/V then our kernel (not overlapped); SDPA flash and cuDNN on the full sequence on
    one GPU; our kernel alone on this rank's data (as one rank of one) and on the full sequence (same shape as SDPA);
    forward + backward of ours and of SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from triton_overlap.ops.attention_on_gathered import backward_on_gathered, forward_on_gathered

    W, r = ctx.world_size, ctx.rank
    records = []
    timed_cp = lambda fn: timed(fn, iters, budget_s=CP_BUDGET_S)  # noqa: E731
    for B, S, Hq, Hkv, D, causal, *rest in shapes:
        dname = next((x for x in rest if isinstance(x, str)), "bf16")  # a shape's dtype: bf16 unless it names one
        dt = CP_DTYPES[dname]
        packed = [x for x in rest if not isinstance(x, str)]
        S_loc = S // W
        ndocs = packed[0] if packed else 0
        cu = None
        if ndocs:  # packed documents: the boundaries, global (the op's argument) and within each shard
            cu = [0]
            for n in doc_lengths(S, ndocs, W):
                cu.append(cu[-1] + n)
        op = to.ContextParallelAttention(ctx, chunks_per_rank=4)
        cfg = op.config_for((S, Hq, Hkv, D, int(causal)))
        g = torch.Generator(device="cuda").manual_seed(0)
        qf, kf, vf = (torch.randn(B, S, h, D, device="cuda", dtype=dt, generator=g) for h in (Hq, Hkv, Hkv))
        q, k, v = (to.zigzag.shard(t, ctx, cu_seqlens=cu) for t in (qf, kf, vf))
        rec = {"B": B, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": causal, "dtype": dname, "world_size": W,
               "gpu": gpu_name(),
               "config": repr(cfg), "note": "", "lead_us": LEAD_US, "docs": ndocs, "cu_seqlens": cu}
        rec["ours_us"] = timed_cp(lambda: op(q, k, v, causal=causal, cu_seqlens=cu))  # replay on, as a user gets it
        rec["replay_stats"] = dict(op.replays.stats)
        plain = to.ContextParallelAttention(ctx, chunks_per_rank=4, config=cfg, replay=False)
        rec["ours_no_replay_us"] = timed_cp(lambda: plain(q, k, v, causal=causal, cu_seqlens=cu))
        rec["host_no_replay_us"] = host_us(lambda: plain(q, k, v, causal=causal, cu_seqlens=cu))
        rec["host_replay_us"] = host_us(lambda: op(q, k, v, causal=causal, cu_seqlens=cu))
        ctx.check()
        kg = torch.empty(W * B, S_loc, Hkv, D, device="cuda", dtype=dt)
        vg = torch.empty_like(kg)
        out, lse = torch.empty_like(q), torch.empty(B, Hq, S_loc, device="cuda", dtype=torch.float32)

        def kernel(qq, kk, vv, kw, vw, oo, ll, rank, world, docs=cu):
            forward_on_gathered(ctx, qq, kk, vv, kw, vw, rank, world, causal, 1.0 / D ** 0.5, cfg, out=oo, lse=ll,
                                cu_seqlens=docs)

        def gather_kv():  # B = 1: [W*B, S_loc, ...] is the workspace layout [B, W*S_loc, ...]
            all_gather_rows(kg, k)
            all_gather_rows(vg, v)

        def kernel_gathered():  # the NCCL variant's kernel on K/V already gathered: what no overlap can beat
            kernel(q, k, v, kg.view(B, W * S_loc, Hkv, D), vg.view(B, W * S_loc, Hkv, D), out, lse, r, W)

        def nccl_then_kernel():
            gather_kv()
            kernel_gathered()

        if B == 1:
            rec["nccl_ag_us"] = timed_cp(nccl_then_kernel)
            rec["gather_us"] = timed_cp(gather_kv)
            rec["kernel_gathered_us"] = timed_cp(kernel_gathered)
            # both in CUDA graphs: the host's enqueue cost drops out
            for key, fn in (("ours_graph_us", lambda: op(q, k, v, causal=causal, cu_seqlens=cu, out=out, lse=lse)),
                            ("nccl_ag_graph_us", nccl_then_kernel)):
                if not group_capturable():
                    rec[key] = None
                    rec["note"] += f"{key}: not captured (the process group is gloo); "
                    continue
                try:
                    rec[key] = timed_cp(capture(fn).replay)
                except Exception as e:  # noqa: BLE001 - recorded in the note
                    rec[key] = None
                    rec["note"] += f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
                ctx.check()
        else:
            rec["nccl_ag_us"], rec["note"] = None, "nccl_ag: B > 1 needs a re-layout; not timed"
        qt, kt, vt = (t.transpose(1, 2) for t in (qf, kf, vf))
        single = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qt, kt, vt, is_causal=causal, enable_gqa=True)
        if cu is not None:  # torch's flash varlen attention on the packed sequence, [T, H, D]
            single = varlen_sdpa(qf[0], kf[0], vf[0], cu, causal)
        if single is None:
            rec["single_gpu_us"] = None
            rec["note"] += "single GPU: torch.nn.attention.varlen missing (torch < 2.10); "
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = single()
                rec["single_gpu_us"] = time_local(single)
            ref = ref if cu is not None else ref.transpose(1, 2)
        cudnn_fwd, cudnn_fwd_bwd = None, None
        if cu is None:
            cudnn_fwd, cudnn_fwd_bwd, note = cudnn_sdpa(qt, kt, vt, causal)
            rec["note"] += note
        else:
            rec["note"] += "cuDNN: packed documents not timed; "
        rec["cudnn_us"] = None if cudnn_fwd is None else time_local(cudnn_fwd)
        rec["fwd_bwd_cudnn_us"] = None if cudnn_fwd_bwd is None else time_local(cudnn_fwd_bwd)
        out_full, lse_full = torch.empty_like(qf), torch.empty(B, Hq, S, device="cuda", dtype=torch.float32)
        # our kernel on this rank's data alone (as one rank of one: its shard's documents are whole documents)
        rec["kernel_only_us"] = time_local(lambda: kernel(q, k, v, k, v, out, lse, 0, 1, local_docs(cu, W)))
        rec["kernel_full_us"] = time_local(lambda: kernel(qf, kf, vf, kf, vf, out_full, lse_full, 0, 1, cu))
        if single is not None:
            rec["kernel_full_err"] = float((out_full.float().reshape(ref.shape) - ref.float()).norm()
                                           / ref.float().norm())
        # forward + backward through autograd (K/V gathered again in backward, dK/dV partials sent to owners)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dout = torch.randn_like(q)

        def fwd_bwd():
            o, _ = op(*leaves, causal=causal, cu_seqlens=cu)
            o.backward(dout)

        rec["fwd_bwd_ours_us"] = timed_cp(fwd_bwd)
        ctx.check()
        # the same with the gathered K/V kept from forward instead of gathered again, and what each holds
        op_keep = to.ContextParallelAttention(ctx, chunks_per_rank=4, keep_kv=True, config=cfg)

        def fwd_bwd_keep():
            o, _ = op_keep(*leaves, causal=causal, cu_seqlens=cu)
            o.backward(dout)

        rec["fwd_bwd_keep_kv_us"] = timed_cp(fwd_bwd_keep)
        ctx.check()
        for key, o in (("saved_mib", op), ("saved_keep_kv_mib", op_keep)):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            held = o(*leaves, causal=causal, cu_seqlens=cu)  # autograd holds what backward needs until `held` goes
            rec[key] = (torch.cuda.memory_allocated() - before) / 2 ** 20
            del held
        if B == 1:
            parts_out = torch.empty(2, B, S_loc, Hkv, D, device="cuda", dtype=torch.float32)
            parts = torch.empty(W, 2, B, S_loc, Hkv, D, device="cuda", dtype=torch.float32)
            scale = 1.0 / D ** 0.5

            def nccl_fwd_bwd():  # gather once (kept), forward, backward, reduce_scatter of the dK/dV partials
                all_gather_rows(kg, k)
                all_gather_rows(vg, v)
                kw, vw = kg.view(B, W * S_loc, Hkv, D), vg.view(B, W * S_loc, Hkv, D)
                o, lse_ = forward_on_gathered(ctx, q, k, v, kw, vw, r, W, causal, scale, cfg, cu_seqlens=cu)
                dq, _ = backward_on_gathered(ctx, q, k, v, kw, vw, o, lse_, dout, r, W, causal, scale, cfg, parts,
                                             cu_seqlens=cu)
                reduce_scatter_rows(parts_out, parts.view(W * 2, *parts.shape[2:]))  # owner o: rows 2o, 2o + 1
                return dq, parts_out[0].to(k.dtype), parts_out[1].to(v.dtype)

            rec["fwd_bwd_nccl_ag_us"] = timed_cp(nccl_fwd_bwd)
        else:
            rec["fwd_bwd_nccl_ag_us"] = None
            rec["note"] += "fwd_bwd_nccl_ag: B > 1 needs a re-layout; not timed; "
        full_leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (qf, kf, vf)]
        dout_full = torch.randn_like(full_leaves[0])

        def sdpa_fwd_bwd():
            torch.nn.functional.scaled_dot_product_attention(*full_leaves, is_causal=causal,
                                                             enable_gqa=True).backward(dout_full)

        if cu is not None:
            packed_leaves = [t.detach()[0].requires_grad_() for t in (qf, kf, vf)]
            varlen_fwd = varlen_sdpa(*packed_leaves, cu, causal)
            sdpa_fwd_bwd = None if varlen_fwd is None else (  # noqa: E731
                lambda: varlen_fwd().backward(dout_full[0].transpose(0, 1)))
        if sdpa_fwd_bwd is None:
            rec["fwd_bwd_single_gpu_us"] = None
        else:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                rec["fwd_bwd_single_gpu_us"] = time_local(sdpa_fwd_bwd)

        def flash(fn):
            def run():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fn()
            return run

        side_by_side(ctx, rec, {
            "ours_us": lambda: op(q, k, v, causal=causal, cu_seqlens=cu),
            "nccl_ag_us": nccl_then_kernel if B == 1 else None,
            "gather_us": gather_kv if B == 1 else None,
            "kernel_gathered_us": kernel_gathered if B == 1 else None,
            "single_gpu_us": None if single is None else flash(single),
            "kernel_only_us": lambda: kernel(q, k, v, k, v, out, lse, 0, 1, local_docs(cu, W)),
            "kernel_full_us": lambda: kernel(qf, kf, vf, kf, vf, out_full, lse_full, 0, 1, cu),
            "cudnn_us": cudnn_fwd}, iters, CP_BUDGET_S)
        side_by_side(ctx, rec, {"fwd_bwd_ours_us": fwd_bwd, "fwd_bwd_nccl_ag_us": nccl_fwd_bwd if B == 1 else None,
                                "fwd_bwd_single_gpu_us": None if sdpa_fwd_bwd is None else flash(sdpa_fwd_bwd),
                                "fwd_bwd_cudnn_us": cudnn_fwd_bwd}, iters, CP_BUDGET_S)
        pairs = sum((b - a) ** 2 for a, b in zip(cu[:-1], cu[1:])) if cu else S * S  # query-key pairs per head
        flops = 4 * B * Hq * pairs * D / (2 if causal else 1)
        single_us, single_fb_us = rec["single_gpu_us"], rec["fwd_bwd_single_gpu_us"]
        rec["fwd_bwd_efficiency"] = None if single_fb_us is None else single_fb_us / (W * rec["fwd_bwd_ours_us"])
        rec["tflops_per_gpu"] = flops / W / rec["ours_us"] / 1e6
        rec["kernel_full_tflops"] = flops / rec["kernel_full_us"] / 1e6
        rec["single_gpu_tflops"] = None if single_us is None else flops / single_us / 1e6
        rec["efficiency"] = None if single_us is None else single_us / (W * rec["ours_us"])
        cudnn_us, cudnn_fb_us = rec["cudnn_us"], rec["fwd_bwd_cudnn_us"]
        rec["cudnn_tflops"] = None if cudnn_us is None else flops / cudnn_us / 1e6
        rec["efficiency_cudnn"] = None if cudnn_us is None else cudnn_us / (W * rec["ours_us"])
        rec["fwd_bwd_efficiency_cudnn"] = None if cudnn_fb_us is None else cudnn_fb_us / (W * rec["fwd_bwd_ours_us"])
        # the most any overlap can gain over the NCCL variant: its time over its kernel's alone
        kg_us = rec.get("kernel_gathered_us")
        rec["nccl_ceiling"] = None if kg_us is None or rec["nccl_ag_us"] is None else rec["nccl_ag_us"] / kg_us
        records.append(rec)
        say(_cp_row(rec))
        write_partial(records)
    return records


def time_columns(ctx, rec, fns, iters) -> None:
    """``rec[key]`` for every ``fns[key]``: timed alone, then all in turns (side_by_side); and
    ``rec[<key minus _us>_graph_us]`` for those that can be captured (capturable), as CUDA-graph replays. A failure
    is recorded in the note and leaves None. ``rec["path"]`` must say already which path ours takes."""
    for k, fn in fns.items():
        rec[k], note = try_time(fn, iters)
        if note:
            rec["note"] += f"{k}: {note}; "
    ctx.check()
    side_by_side(ctx, rec, fns, iters, budget_s=2.0)
    for k, fn in fns.items():
        key = k.replace("_us", "_graph_us")
        rec[key] = None
        if capturable(k, rec):
            try:
                rec[key] = timed(capture(fn).replay, iters)
            except Exception as e:  # noqa: BLE001 - recorded in the note
                rec["note"] += f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
    ctx.check()


def capturable(key: str, rec: dict) -> bool:
    """Whether the timed function ``key`` (an eager column's key) can be captured in a CUDA graph: not where it calls
    the process group and that is gloo (--shared-gpu; a failed capture leaves torch's allocator unusable)."""
    uses_group = (key in ("nccl_us", "nccl_symm_us") or key == "ours_us" and rec.get("path") == "fallback"
                  or key == "ours_unfused_us" and rec.get("unfused_algorithm") == "process group")
    return not uses_group or group_capturable()


#: consecutive calls captured in one CUDA graph for the back-to-back columns (``*_b2b_us``, --b2b-calls)
B2B_CALLS = 64


def back_to_back(fn, calls: int):
    """``fn`` called ``calls`` times in a row: what time_back_to_back captures in one graph."""
    def run():
        for _ in range(calls):
            fn()
    return run


def time_back_to_back(ctx, rec, fns, iters, calls: int | None = None, budget_s: float = 2.0) -> None:
    """``rec[<key minus _us>_b2b_us]`` for every ``fns[key]`` (None: left out): ``calls`` consecutive calls captured
    in one CUDA graph, the replay's time over ``calls``, as serving engines time a decode step's collectives: no
    launch gap between calls and no lining up of the ranks before each (only before each replay, timing.time_dist),
    so each call's latency, where one call per replay (``*_graph_us``) also holds the start and the end of a
    kernel that nothing overlaps. The graphs are timed in turns within each iteration (timing.time_interleaved).
    Columns that call a gloo process group are not captured (capturable); a failed capture or replay is recorded
    in the note and leaves None, and the benchmark goes on."""
    calls = calls or B2B_CALLS
    rec["b2b_calls"] = calls
    graphs = {}
    for k, fn in fns.items():
        key = k[:-3] + "_b2b_us"
        rec[key] = None
        if fn is None:
            continue
        if not capturable(k, rec):
            rec["note"] += f"{key}: not captured (the process group is gloo); "
            continue
        try:
            graphs[key] = capture(back_to_back(fn, calls))
        except Exception as e:  # noqa: BLE001 - recorded in the note
            rec["note"] += f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
    ctx.check()
    if not graphs:
        return
    try:
        per_replay = time_interleaved({k: g.replay for k, g in graphs.items()}, iters, budget_s=budget_s,
                                      lead_us=LEAD_US)
    except Exception as e:  # noqa: BLE001 - one failing replay: time the others one at a time
        rec["note"] += f"b2b in turns: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
        per_replay = {}
        for k, g in graphs.items():
            per_replay[k], note = try_time(g.replay, iters)
            if note:
                rec["note"] += f"{k}: {note}; "
    for k, us in per_replay.items():
        rec[k] = None if us is None else us / calls
    ctx.check()


#: message sizes in bytes (bf16): 2 KiB to 128 MiB in powers of 4, 256 KiB and 256 MiB
AR_SIZES = sorted([2048 * 4 ** k for k in range(9)] + [256 << 10, 256 << 20])


def bench_all_reduce(ctx, sizes, iters, write_partial, calls: int | None = None):
    """Ours (as a user gets it, and each kernel forced) against the process group's all_reduce (NCCL), NCCL on a
    buffer registered for its symmetric kernels (nccl_symm.SymmetricBuffer, where torch and NCCL allow it) and
    torch's symmetric-memory one-shot and two-shot all-reduces: eager, as CUDA-graph replays of one call, and
    ``calls`` calls back to back in one graph (time_back_to_back). The bound is an empty kernel's latency plus the
    message over the measured bandwidth of a copy into a peer's memory."""
    import torch.distributed._symmetric_memory as symm_mem

    from nccl_symm import SymmetricBuffer, is_symmetric_kernel, nccl_kernels, version_text

    W, group = ctx.world_size, dist.group.WORLD.group_name
    ours = to.AllReduce(ctx)
    one_shot = to.AllReduce(ctx, algorithm="one_shot", fallback="never", name="all_reduce.one_shot")
    two_shot = to.AllReduce(ctx, algorithm="two_shot", fallback="never", name="all_reduce.two_shot")
    latency = time_dist(capture(lambda: spin(0)).replay, iters)
    probe = ctx.symmetric("bench.bandwidth", (64 << 20,), torch.uint8)
    peer = probe.peer((ctx.rank + 1) % W)
    bw = (64 << 20) / time_dist(lambda: peer.copy_(probe.local), 10)  # bytes per µs
    # one registration for the largest message; each size uses its head (offset 0 on every rank)
    nccl_symm = SymmetricBuffer(dist.group.WORLD, max(sizes) // 2, torch.bfloat16, torch.device("cuda"),
                                dist.get_backend())
    records = []
    for size in sizes:
        n = size // 2
        torch.manual_seed(ctx.rank)
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        buf = x.clone()
        rec = {"bytes": size, "numel": n, "world_size": W, "gpu": gpu_name(), "note": "", "lead_us": LEAD_US,
               "latency_us": latency, "peer_bandwidth_gbs": bw / 1e3, "bound_us": latency + size / bw,
               "nccl_version": version_text(nccl_symm.version), "nccl_symm": nccl_symm.describe()}
        rec["note"] += f"nccl_symm: {rec['nccl_symm']}; "
        fns = {"ours_us": lambda: ours(x, out=out), "one_shot_us": lambda: one_shot(x, out=out),
               "two_shot_us": lambda: two_shot(x, out=out), "nccl_us": lambda: dist.all_reduce(buf)}
        sym_nccl = nccl_symm.view(n)
        if sym_nccl is not None:
            sym_nccl.copy_(x)
            fns["nccl_symm_us"] = lambda: dist.all_reduce(sym_nccl)
        try:
            sym = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
            symm_mem.rendezvous(sym, group)
            sym.copy_(x)
            fns["torch_one_shot_us"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(sym, "sum", group)
            fns["torch_two_shot_us"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(sym, "sum", group)
        except Exception as e:  # noqa: BLE001 - recorded in the note
            rec["note"] += f"torch symm_mem: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
        ref = x.double()
        dist.all_reduce(ref)
        for name, kernel in (("one_shot", one_shot), ("two_shot", two_shot)):  # also sizes the slots
            kernel(x, out=out)
            rec[f"{name}_rel_err"] = float((out.double() - ref).norm() / ref.norm())
        ours(x, out=out)
        rec["path"] = ours.last_path
        if dist.get_backend() == "nccl":
            for key, fn in (("nccl_kernels", fns["nccl_us"]), ("nccl_symm_kernels", fns.get("nccl_symm_us"))):
                if fn is None:
                    continue
                try:  # which kernel NCCL ran: a symmetric one falls back to the ordinary one silently
                    rec[key] = nccl_kernels(fn)
                except Exception as e:  # noqa: BLE001 - recorded in the note
                    rec["note"] += f"{key}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
            if "nccl_symm_kernels" in rec and not any(map(is_symmetric_kernel, rec["nccl_symm_kernels"])):
                rec["note"] += (f"nccl_symm: NCCL ran {', '.join(rec['nccl_symm_kernels']) or 'no kernel'}, "
                                "not a symmetric kernel, at this size; ")
        time_columns(ctx, rec, fns, iters)
        time_back_to_back(ctx, rec, {k: fns.get(k) for k in ("ours_us", "one_shot_us", "nccl_us", "nccl_symm_us",
                                                              "torch_one_shot_us", "torch_two_shot_us")},
                          iters, calls)
        records.append(rec)
        write_partial(records)
        say(ar_row(rec))
    nccl_symm.close()  # collective: after the last size on every rank (an error ends the process instead)
    return records


#: AllReduce + residual + RMSNorm: batch rows M x hidden H (bf16), the decode shapes of the fused op's target
#: (report.AR_RMSNORM_TARGET)
AR_RMSNORM_SHAPES = [(m, h) for h in (4096, 8192) for m in (1, 4, 16, 64)]
#: the RMSNorm's epsilon (Llama's)
AR_RMSNORM_EPS = 1e-5


def rmsnorm_paths(x, residual, weight, eps, fused, one_shot, buf):
    """The three ways to ``(rmsnorm(residual + sum over ranks of x) * weight, residual + sum over ranks of x)`` the
    AllReduce + RMSNorm benchmark times, each a function returning that pair:

    * ``ours_us``: ``fused`` (an AllReduceRMSNorm), one kernel;
    * ``nccl_us``: the three calls serving engines fuse: the process group's all_reduce in place on ``buf`` (the
      row-parallel GEMM's output, which the caller owns; its values grow with every call, which does not change the
      time, so fill ``buf`` with ``x`` before a call whose result is checked), torch.add, and
      torch.nn.functional.rms_norm;
    * ``one_shot_us``: our AllReduce ``one_shot`` (x is not modified), torch.add and rms_norm.
    """
    H = x.shape[-1]
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    summed, nccl_residual, one_shot_residual = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def ours():
        return fused(x, residual, weight, eps=eps, out=out, residual_out=new_residual)

    def nccl():
        dist.all_reduce(buf)
        torch.add(residual, buf, out=nccl_residual)
        return torch.nn.functional.rms_norm(nccl_residual, (H,), weight, eps), nccl_residual

    def ours_one_shot():
        one_shot(x, out=summed)
        torch.add(residual, summed, out=one_shot_residual)
        return torch.nn.functional.rms_norm(one_shot_residual, (H,), weight, eps), one_shot_residual

    return {"ours_us": ours, "nccl_us": nccl, "one_shot_us": ours_one_shot}


def rmsnorm_errors(x, residual, weight, eps, paths, buf) -> dict:
    """One call of each of ``paths`` (rmsnorm_paths; ``buf`` filled with ``x`` first), compared:
    ``rel_err``/``residual_rel_err``: ours against the NCCL path (normed, new residual); ``*_rel_err_fp64``: each
    path's normed output against float64 (the sum over ranks through the process group in float64)."""
    buf.copy_(x)
    got = {k: tuple(t.clone() for t in fn()) for k, fn in paths.items()}
    h = x.double()
    dist.all_reduce(h)
    h += residual.double()
    ref = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.double()
    err = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
    rec = {"rel_err": err(got["ours_us"][0], got["nccl_us"][0]),
           "residual_rel_err": err(got["ours_us"][1], got["nccl_us"][1])}
    rec.update({f"{k[:-3]}_rel_err_fp64": err(normed, ref) for k, (normed, _) in got.items()})
    return rec


def runnable(rec, fns) -> dict:
    """The functions of ``fns`` that run: each called once, one that raises left out with a note."""
    kept = {}
    for k, fn in fns.items():
        try:
            fn()
            kept[k] = fn
        except Exception as e:  # noqa: BLE001 - recorded in the note
            rec["note"] += f"{k}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
    return kept


def bench_all_reduce_rmsnorm(ctx, shapes, iters, write_partial, calls: int | None = None):
    """AllReduce + residual add + RMSNorm on [M, H] bf16 (``shapes``: (M, H)): ours fused (AllReduceRMSNorm,
    fallback="never") against the three separate calls (NCCL all_reduce, torch.add, torch's rms_norm) and against
    our one-shot AllReduce followed by torch's add and rms_norm (rmsnorm_paths): eager (timed alone, then in turns),
    as CUDA-graph replays of one call, and ``calls`` calls back to back in one graph (time_back_to_back); with
    ours' relative error against the separate path per row (rmsnorm_errors)."""
    W, eps = ctx.world_size, AR_RMSNORM_EPS
    fused = to.AllReduceRMSNorm(ctx, fallback="never")
    one_shot = to.AllReduce(ctx, algorithm="one_shot", fallback="never", name="all_reduce_rmsnorm.one_shot")
    records = []
    for M, H in shapes:
        torch.manual_seed(ctx.rank)
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(1000)  # the residual stream and the norm's weight are replicated: the same on every rank
        residual = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
        buf = x.clone()
        rec = {"M": M, "H": H, "dtype": "bfloat16", "eps": eps, "world_size": W, "gpu": gpu_name(), "note": "",
               "lead_us": LEAD_US}
        paths = rmsnorm_paths(x, residual, weight, eps, fused, one_shot, buf)
        try:  # also sizes both ops' slots before any capture
            rec.update(rmsnorm_errors(x, residual, weight, eps, paths, buf))
        except Exception as e:  # noqa: BLE001 - a path that cannot run here (a group across hosts) is left out
            rec["note"] += f"error check: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
            paths = runnable(rec, paths)
        rec["path"] = fused.last_path
        time_columns(ctx, rec, paths, iters)
        time_back_to_back(ctx, rec, paths, iters, calls)
        records.append(rec)
        write_partial(records)
        say(ar_rmsnorm_row(rec))
    return records


GEMM_AR_M = [1, 4, 16, 32, 64, 128, 256, 2048]
GEMM_AR_KN = [(28672, 8192), (8192, 8192), (14336, 4096)]  # K over all ranks (each has K/W), N


def bench_gemm_ar(ctx, shapes, iters, write_partial):
    """GEMM + AllReduce, ``shapes`` (M, K, N) with K over all ranks: ours as a user gets it (``ours_us``: the fused
    kernel up to its row limit, above it matmul + our AllReduce), the fused kernel forced (``fused_us``), matmul +
    our AllReduce forced (``ours_unfused_us``), torch.matmul + dist.all_reduce (NCCL) and the GEMM alone, eager and
    as CUDA-graph replays: the fused and unfused columns side by side give the row limit."""
    W = ctx.world_size
    op = to.GEMMAllReduce(ctx)
    fused = to.GEMMAllReduce(ctx, algorithm="fused", name="gemm_ar.fused")
    unfused = to.GEMMAllReduce(ctx, fused_max_rows=0, name="gemm_ar.unfused")
    records = []
    for M, K, N in shapes:
        torch.manual_seed(ctx.rank)
        a = torch.randn(M, K // W, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K // W, device="cuda", dtype=torch.bfloat16).t()  # as nn.Linear's weight.t()
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        out_f = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

        def nccl():
            torch.matmul(a, w, out=y)
            dist.all_reduce(y)

        rec = {"M": M, "K": K, "N": N, "world_size": W, "gpu": gpu_name(), "note": "", "lead_us": LEAD_US}
        op(a, w, out=out)  # sizes the AllReduce's slots before any capture
        ref = (a.double() @ w.double())
        dist.all_reduce(ref)
        rec["rel_err"] = float((out.double() - ref).norm() / ref.norm())
        rec["path"], rec["algorithm"] = op.last_path, op.last_algorithm
        fns = {"ours_us": lambda: op(a, w, out=out), "nccl_us": nccl, "gemm_us": lambda: torch.matmul(a, w, out=y)}
        if fused.fits(M, N):
            fused(a, w, out=out_f)
            rec["fused_rel_err"] = float((out_f.double() - ref).norm() / ref.norm())
            fns["fused_us"] = lambda: fused(a, w, out=out_f)
        unfused(a, w, out=y)
        rec["unfused_algorithm"] = unfused.last_algorithm
        fns["ours_unfused_us"] = lambda: unfused(a, w, out=y)
        time_columns(ctx, rec, fns, iters)
        records.append(rec)
        write_partial(records)
        say(gemm_ar_row(rec))
    return records


def _gather(a):
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a)
    return parts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=["ag_gemm", "ag_gemm_fp8", "gemm_rs", "cp_attention", "all_reduce",
                                      "all_reduce_rmsnorm", "gemm_ar", "moe", "ep", "ep_ll", "model"])
    p.add_argument("--shapes", nargs="*", help="ag_gemm, ag_gemm_fp8: M,K,N (M gathered, N per rank); gemm_rs: "
                   "M,K,N (K per rank, output [M/W, N]); cp_attention: B,S,Hq,Hkv,D,causal[,documents][,fp16|bf16] "
                   "(S in all, causal 0 or 1, documents: packed documents of random lengths; bf16 unless named); "
                   "all_reduce: bytes; all_reduce_rmsnorm: M,H (rows, hidden; bf16); gemm_ar: M,K,N (K over all "
                   "ranks); moe: model,tokens per rank,routing (moe.parse_shape, e.g. deepseek-v3,4096,zipf); ep: "
                   "the same for ep.parse_shape's models; ep_ll: model,tokens per rank,bf16|fp8; model: "
                   "train|decode,8b|70b,layers,batch,tokens (model.parse_cases). Default: the standard list "
                   "(cp_attention on one GPU: CP_SHAPES_ONE_GPU)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--b2b-calls", type=int, default=B2B_CALLS, metavar="CALLS",
                   help="all_reduce, all_reduce_rmsnorm: calls back to back in one CUDA graph for the *_b2b_us "
                   f"columns (default {B2B_CALLS})")
    p.add_argument("--lead-us", type=float, default=LEAD_US, help="see LEAD_US; 0: the GPU idles before each call")
    p.add_argument("--shared-gpu", action="store_true", help="every rank on GPU 0 over gloo: runs the benchmark "
                   "end to end where one GPU is lent; its timings mean nothing")
    p.add_argument("--virtual-hosts", type=int, default=None, metavar="N",
                   help="treat the ranks as N hosts of equal size (TRITON_OVERLAP_VIRTUAL_HOSTS): data between them "
                   "goes through the process group, as between machines")
    p.add_argument("--profile", metavar="DIR", help="also profile every timed column (timing.profile_to): one "
                   "table of kernels per column and case in DIR")
    p.add_argument("--profile-stacks", action="store_true", help="with --profile: also a table by Python stack")
    p.add_argument("--out", default="bench-results",
                   help="folder for the results (default: bench-results; benchmarks/results holds the committed ones)")
    args = p.parse_args()
    if args.b2b_calls < 1:
        p.error("--b2b-calls must be at least 1")
    globals()["LEAD_US"] = args.lead_us
    if not torch.cuda.is_available():
        raise SystemExit("bench: needs GPUs (timings on the host backend would mean nothing)")
    if args.shared_gpu and os.path.abspath(args.out) == os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                    "results"):
        raise SystemExit("bench: --shared-gpu timings mean nothing; they never go to benchmarks/results")
    if args.profile and os.path.abspath(args.out) == os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                 "results"):
        raise SystemExit("bench: --profile slows the timed calls' neighbours; its results never go to "
                         "benchmarks/results")
    init(shared_gpu=args.shared_gpu)
    if args.profile:
        profile_to(args.profile, stacks=args.profile_stacks)
    shapes = ([tuple(v if v in CP_DTYPES else int(v) for v in s.split(",")) for s in args.shapes]
              if args.shapes and args.op not in ("moe", "ep", "ep_ll", "model") else None)
    if args.virtual_hosts:
        os.environ["TRITON_OVERLAP_VIRTUAL_HOSTS"] = str(args.virtual_hosts)
    with to.Context() as ctx:
        def hosts(recs):  # every record says how many hosts the group spans
            for r in recs:
                r["num_hosts"] = ctx.num_hosts
            return recs

        def writer(write_fn, planned, *lead):
            """Each partial write (one record per planned shape, in order) names the shapes still to come, so a
            run cut short says what it did not measure."""
            return lambda recs: ctx.rank == 0 and write_fn(*lead, hosts(recs), ctx.world_size, args.out,
                                                           pending=planned[len(recs):])

        if args.op == "all_reduce":
            say(AR_HEADER)
            sizes = [s[0] for s in shapes] if shapes else AR_SIZES
            bench_all_reduce(ctx, sizes, args.iters, writer(write_all_reduce, sizes), args.b2b_calls)
        elif args.op == "all_reduce_rmsnorm":
            say(AR_RMSNORM_HEADER)
            planned = shapes or AR_RMSNORM_SHAPES
            bench_all_reduce_rmsnorm(ctx, planned, args.iters, writer(write_all_reduce_rmsnorm, planned),
                                     args.b2b_calls)
        elif args.op == "gemm_ar":
            say(GEMM_AR_HEADER)
            planned = shapes or [(m, k, n) for k, n in GEMM_AR_KN for m in GEMM_AR_M]
            bench_gemm_ar(ctx, planned, args.iters, writer(write_gemm_ar, planned))
        elif args.op == "moe":
            from moe import MOE_SHAPES, bench_moe, parse_shape
            from moe_report import MOE_HEADER, write_moe

            say(MOE_HEADER)
            planned = [parse_shape(s) for s in args.shapes] if args.shapes else MOE_SHAPES
            bench_moe(ctx, planned, args.iters, writer(write_moe, planned), lead_us=LEAD_US)
        elif args.op == "ep":
            from ep import EP_SHAPES, bench_ep, parse_shape as parse_ep
            from ep_report import EP_HEADER, write_ep
            from moe import gpu_name

            say(EP_HEADER)
            planned = [parse_ep(s) for s in args.shapes] if args.shapes else EP_SHAPES
            bench_ep(ctx, planned, args.iters, writer(write_ep, planned), gpu_name(), lead_us=LEAD_US)
        elif args.op == "ep_ll":
            from ep_low_latency import EP_LL_HEADER, EP_LL_SHAPES, bench_ep_low_latency, write_ep_low_latency
            from ep_low_latency import parse_shape as parse_ep_ll
            from moe import gpu_name

            say(EP_LL_HEADER)
            planned = [parse_ep_ll(s) for s in args.shapes] if args.shapes else EP_LL_SHAPES
            bench_ep_low_latency(ctx, planned, args.iters, writer(write_ep_low_latency, planned), gpu_name(),
                                 lead_us=LEAD_US)
        elif args.op == "model":
            from model import DEFAULT_CASES, bench_model, parse_cases
            from model_report import write_model

            planned = parse_cases(args.shapes) if args.shapes else DEFAULT_CASES
            bench_model(ctx, planned, args.iters, writer(write_model, planned), lead_us=LEAD_US)
        elif args.op == "cp_attention":  # shapes: B,S,Hq,Hkv,D,causal(0/1)[,documents]
            say(CP_HEADER)
            default = CP_SHAPES_ONE_GPU if ctx.world_size == 1 else CP_SHAPES
            planned = [(*s[:5], bool(s[5]), *s[6:]) for s in shapes] if shapes else default
            bench_cp_attention(ctx, planned, args.iters, writer(write_cp, planned))
        else:
            say(HEADER)
            planned = shapes or (RS_SHAPES if args.op == "gemm_rs" else AG_SHAPES)
            bench = {"ag_gemm": bench_ag_gemm, "ag_gemm_fp8": bench_ag_gemm_fp8, "gemm_rs": bench_gemm_rs}[args.op]
            records = bench(ctx, planned, args.iters, writer(write, planned, args.op))
            if ctx.rank == 0:
                geo = write(args.op, hosts(records), ctx.world_size, args.out)
                say(f"geometric-mean speed-up over NCCL + cuBLAS: {geo:.3f}x")
    say(f"bench: results in {os.path.abspath(args.out)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
