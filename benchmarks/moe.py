"""Tensor-parallel MoE benchmarks: ``ag_moe_gemm``, ``moe_gemm_rs`` and the ``TPMoE`` layer (forward + backward)
against NCCL + ``torch._grouped_mm``, the bound and our grouped GEMM alone. ``bench.py moe`` calls ``bench_moe``;
``moe_report.write_moe`` writes ``moe-<gpu>x<W>.{json,md}``. GPUs only.

A shape is (model, tokens per rank, routing). A model is (E experts, top-k, K model width, N expert hidden width);
the tensor-parallel split gives each rank gate/up columns ``[E, K, 2N/W]`` and down rows ``[E, N/W, K]``. Routing:
"balanced" (each token's k distinct experts drawn uniformly) or "zipf" (drawn by a Zipf popularity over the experts,
exponent ZIPF_EXPONENT, in a random order); every rank draws the same (seeded). Columns, per shape:

* AllGather + grouped GEMM (``ag_*``), x [T/W, K] @ w13 -> [T, k, 2N/W]: ours (overlap, routing checks off: the
  layer's way); ours as a user gets it (``ag_user_us``: fallback="auto", routing checked: one device-to-host copy
  and a host exchange); ours into the expert-sorted layout (``ag_ours_sorted_us``, the layer's path); NCCL
  all_gather + sort by expert + ``torch._grouped_mm`` + scatter back to token order; the bound, ``torch._grouped_mm``
  alone on the gathered, sorted rows; our grouped GEMM alone on those rows (``ag_grouped_gemm`` as a world of one,
  nothing to wait for). The last two as CUDA-graph replays (GPU time only).
* grouped GEMM + combine + ReduceScatter (``rs_*``), h [T, k, N/W] @ w2 -> this rank's [T/W, K]: ours (token-major
  h), ours on the sorted layout (``rs_ours_sorted_us``), NCCL: sort + ``torch._grouped_mm`` + top-k combine in
  float32 + ``reduce_scatter`` of bf16 rows; the bound and our grouped GEMM alone on the sorted rows (no combine;
  the rows read by TMA, as ``moe_gemm_rs`` reads the sorted layout).
* the layer (``layer_*``): ``TPMoE`` forward + backward and forward alone, against the same layer written with
  torch autograd over NCCL all_gather / reduce_scatter and ``torch._grouped_mm`` (``torch_moe_layer``), on the
  same parameters. The router decides the routing there: "zipf" skews it with a bias along the inputs' mean.

Timing as bench.py's: CUDA events, ranks lined up on the device before each call with the host ahead (``lead_us``),
median over iterations, max over ranks, the columns of each group timed in turns (timing.time_interleaved).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

import triton_overlap as to
from moe_report import moe_row
from triton_overlap.context.collectives import all_gather_rows, reduce_scatter_rows
from triton_overlap.kernels.grouped_gemm import launch_ag_grouped, reads_rows_by_tma, stage_rows
from triton_overlap.ops.all_gather_moe import consumer_schedule
from triton_overlap.ops.moe_routing import count_ids
from triton_overlap.timing import capture, time_interleaved
from triton_overlap.torchrun import say
from triton_overlap.tuning import MOE_ROUTINGS as ROUTINGS, ZIPF_EXPONENT, zipf_popularity
from triton_overlap.tuning import moe_routing_ids as routing_ids  # the routings tune.py moe draws too

#: name -> (experts, top-k, K model width, N expert hidden width)
MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "deepseek-v3": (256, 8, 7168, 2048)}
TOKENS_PER_RANK = (4096, 16384)
MOE_SHAPES = [(m, t, r) for m in MODELS for t in TOKENS_PER_RANK for r in ROUTINGS]
LEAD_US = 500.0  # bench.py's default
BUDGET_S = 2.0  # per column and group: large shapes take fewer iterations


def parse_shape(text: str) -> tuple:
    """``"model,tokens_per_rank,routing"`` (``--shapes`` of ``bench.py moe``) -> a shape of MOE_SHAPES' form."""
    model, tokens, routing = text.split(",")
    if model not in MODELS or routing not in ROUTINGS:
        raise ValueError(f"moe shape {text!r}: model one of {sorted(MODELS)}, routing one of {ROUTINGS}")
    return model, int(tokens), routing


def load_imbalance(ids: torch.Tensor, experts: int) -> float:
    """The busiest expert's rows over the mean rows per expert (1.0: perfectly balanced)."""
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=experts).double()
    return float(counts.max() / counts.mean())


def gpu_name() -> str:
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "_")


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------ baselines
def expert_offsets(flat_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """int32 [E]: the end of each expert's rows among rows sorted by expert (``torch._grouped_mm``'s ``offs``), with
    no host synchronisation (torch.bincount reads the largest id back), so the baselines can be captured."""
    return count_ids(flat_ids, experts).cumsum(0).to(torch.int32)


def sort_by_expert(flat_ids: torch.Tensor) -> torch.Tensor:
    """The rows' order sorted by expert, stable; the ids as int32 keys (half the radix passes of int64)."""
    return torch.argsort(flat_ids.to(torch.int32), stable=True)


class _AllGather(torch.autograd.Function):
    """NCCL all_gather of rows; backward: reduce_scatter of the gradient."""

    @staticmethod
    def forward(ctx, x):
        W = dist.get_world_size()
        return all_gather_rows(x.new_empty(x.shape[0] * W, *x.shape[1:]), x.contiguous())

    @staticmethod
    def backward(ctx, g):
        W = dist.get_world_size()
        return reduce_scatter_rows(g.new_empty(g.shape[0] // W, *g.shape[1:]), g.contiguous())


class _ReduceScatter(torch.autograd.Function):
    """NCCL reduce_scatter of rows; backward: all_gather of the gradient."""

    @staticmethod
    def forward(ctx, x):
        W = dist.get_world_size()
        return reduce_scatter_rows(x.new_empty(x.shape[0] // W, *x.shape[1:]), x.contiguous())

    @staticmethod
    def backward(ctx, g):
        W = dist.get_world_size()
        return all_gather_rows(g.new_empty(g.shape[0] * W, *g.shape[1:]), g.contiguous())


def torch_moe_layer(x, router_w, w13, w2, topk: int, renormalize: bool = True):
    """TPMoE's computation in torch autograd over NCCL: router on this rank's tokens, all_gather of ids and weights
    and of the tokens, sort by expert, two ``torch._grouped_mm`` with SwiGLU between, top-k combine
    from the sorted rows in float32 (index_add), reduce_scatter of bf16 rows. ``x`` [T/W, K] -> [T/W, K]."""
    E, hl = w13.shape[0], w2.shape[1]
    p, ids = torch.softmax(x.float() @ router_w.float().t(), dim=-1).topk(topk, dim=-1)
    if renormalize:
        p = p / p.sum(-1, keepdim=True)
    both = _AllGather.apply(torch.cat([p, ids.float()], dim=1))
    p_all, flat = both[:, :topk], both[:, topk:].long().reshape(-1)
    xg = _AllGather.apply(x)
    order = sort_by_expert(flat)
    offs = expert_offsets(flat, E)
    h = torch._grouped_mm(xg[order // topk], w13, offs=offs)
    y = torch._grouped_mm(torch.nn.functional.silu(h[:, :hl]) * h[:, hl:], w2, offs=offs)
    # the top-k combine straight from the sorted rows: each row weighted, added into its token in float32
    combined = torch.zeros(xg.shape[0], y.shape[1], device=y.device, dtype=torch.float32).index_add(
        0, order // topk, y.float() * p_all.reshape(-1)[order].unsqueeze(-1))
    return _ReduceScatter.apply(combined.to(x.dtype))


def consumer_alone(ctx, ag_op, cfg, rows, w, row_experts, out, contig: bool = False):
    """Our grouped GEMM alone on rows already here (for the RS shapes too: the GEMM core both ops' kernels share,
    without MoE-GEMM-ReduceScatter's combine): the AllGather grouped GEMM that ``launch_ag_grouped`` picks for these
    operands (on Hopper the Gluon kernel where K <= grouped_gemm_hopper.MAX_K or the rows are read by TMA, as the ops
    pick theirs) as a world of one (no tile waits), ``rows`` [T, K] as tokens routed to ``row_experts`` [T, topk],
    ``out`` [T * topk, N] in the expert-sorted layout (the bound's). ``contig``: the rows are sorted by expert
    (top-1), and each tile reads its consecutive rows by TMA, as moe_gemm_rs reads the sorted layout of ag_moe_gemm;
    else as ag_moe_gemm reads them: where its ranks would send rows sorted by expert (``ag_op.sends_rows``), the
    rows first copied in expert order (the pass a rank makes over its own rows before sending them, here over all),
    then read by TMA; else gathered token by token. Returns the launch as a function."""
    T, topk = row_experts.shape
    by_tma = reads_rows_by_tma(ctx, cfg, rows, w, out)
    rows_sent = not contig and cfg.sends_rows(w.shape[2], by_tma)
    sched = consumer_schedule(cfg, T, rows.device, topk if rows_sent else None)
    flags = torch.ones(1, dtype=torch.int32, device=rows.device)
    if not rows_sent:
        _, routes, table = ag_op.route(sched, row_experts, w.shape[0], True)
        return lambda: launch_ag_grouped(ctx, cfg, rows, rows, w, out, routes, table, flags, sched.layout,
                                         op=ag_op.op, rank=0, contig=contig)
    _, routes, table, tokens, _ = ag_op.route_rows(sched, row_experts, w.shape[0], True)
    sent = torch.empty(T * topk, rows.shape[1], dtype=rows.dtype, device=rows.device)

    def run():
        stage_rows(ctx, rows, sent, tokens, sched.rows.pos, T, 0)
        return launch_ag_grouped(ctx, cfg, sent, sent, w, out, routes, table, flags, sched.layout, op=ag_op.op,
                                 rank=0, contig=by_tma)
    return run


# ---------------------------------------------------------------------------------------------------- timing
def _timed(ctx, rec, fns, iters, lead_us):
    """``rec[k]`` for each ``fns[k]``, timed in turns; a column whose first call fails is left None, with why in
    the note."""
    ok = {}
    for k, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            ok[k] = fn
        except Exception as e:  # noqa: BLE001 - recorded in the note
            rec[k] = None
            rec["note"] += f"{k}: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
    ctx.check()
    rec.update(time_interleaved(ok, iters, budget_s=BUDGET_S, lead_us=lead_us))
    ctx.check()


def _graph(rec, key, fn):
    """A CUDA-graph replay of ``fn`` (None and a note where the capture fails)."""
    try:
        return capture(fn).replay
    except Exception as e:  # noqa: BLE001 - recorded in the note
        rec["note"] += f"{key}: not captured: {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
        return None


def bench_moe(ctx, shapes, iters, write_partial, lead_us: float = LEAD_US) -> list[dict]:
    """One record per shape (``MOE_SHAPES``' form), ``write_partial(records)`` after each."""
    ops = SimpleNamespace(  # ours: the overlap, routing checks off (the layer's way); user: as a user gets it
        ag=to.AllGatherMoEGEMM(ctx, fallback="never", check_routing=False, name="bench.moe_ag"),
        ag_user=to.AllGatherMoEGEMM(ctx, name="bench.moe_ag.user"),
        rs=to.MoEGEMMReduceScatter(ctx, fallback="never", check_routing=False, name="bench.moe_rs"),
        rs_user=to.MoEGEMMReduceScatter(ctx, name="bench.moe_rs.user"))
    records = []
    for model, tokens, routing in shapes:
        E, topk, K, N = MODELS[model]
        rec = {"model": model, "E": E, "topk": topk, "K": K, "N": N, "tokens_per_rank": tokens, "routing": routing,
               "world_size": ctx.world_size, "gpu": gpu_name(), "note": "", "lead_us": lead_us,
               "zipf_exponent": ZIPF_EXPONENT}
        bench_ops(ctx, ops, rec, iters)
        torch.cuda.empty_cache()
        bench_layer(ctx, rec, iters)
        torch.cuda.empty_cache()
        records.append(rec)
        write_partial(records)
        say(moe_row(rec))
    return records


def _replays(ctx, rec, fns, iters) -> None:
    """``rec[key]``: each ``fns[key]`` captured in a CUDA graph and its replay timed (None where it fails)."""
    for key, fn in fns.items():
        replay = _graph(rec, key, fn)
        rec[key] = None if replay is None else time_interleaved({key: replay}, iters, budget_s=BUDGET_S,
                                                                lead_us=rec["lead_us"])[key]
    ctx.check()


def bench_ops(ctx, ops, rec, iters) -> None:
    """The ``ag_*`` and ``rs_*`` columns of ``rec``'s shape."""
    E, topk, K, N, tokens = rec["E"], rec["topk"], rec["K"], rec["N"], rec["tokens_per_rank"]
    W, dev, bf = ctx.world_size, torch.device("cuda"), torch.bfloat16
    T, nl = tokens * W, N // W
    P = T * topk
    torch.manual_seed(ctx.rank)
    x = torch.randn(tokens, K, device=dev, dtype=bf)
    w13 = (torch.randn(E, K, 2 * nl, device=dev) * K ** -0.5).to(bf)
    w2 = (torch.randn(E, nl, K, device=dev) * N ** -0.5).to(bf)
    h = torch.randn(T, topk, nl, device=dev, dtype=bf)
    ids = routing_ids(T, E, topk, rec["routing"]).to(dev)
    weights = torch.softmax(torch.randn(T, topk, generator=torch.Generator().manual_seed(1)), dim=-1).to(dev)
    rec["imbalance"] = load_imbalance(ids, E)
    flat = ids.reshape(-1)
    offs = expert_offsets(flat, E)
    ag, rs, lead = ops.ag, ops.rs, rec["lead_us"]

    # ---- AllGather + grouped GEMM
    out_ag = torch.empty(T, topk, 2 * nl, device=dev, dtype=bf)
    ref_ag = torch.empty_like(out_ag)
    sorted_ag = torch.empty(P, 2 * nl, device=dev, dtype=bf)
    gathered = torch.empty(T, K, device=dev, dtype=bf)

    def nccl_ag():
        all_gather_rows(gathered, x)
        order = sort_by_expert(flat)
        y = torch._grouped_mm(gathered[order // topk], w13, offs=expert_offsets(flat, E))
        ref_ag.view(P, -1)[order] = y  # back to token order

    _, routing = ag(x, w13, ids, sorted_output=True, out=sorted_ag)  # its layout serves the sorted columns
    nccl_ag()
    rows_sorted = gathered[routing.order // topk]  # the gathered tokens' rows, sorted by expert
    sorted_experts = flat[routing.order].view(-1, 1)
    bound_out = torch.empty(P, 2 * nl, device=dev, dtype=bf)
    ag(x, w13, ids, out=out_ag)
    rec["ag_rel_err_vs_nccl"] = rel_err(out_ag, ref_ag)
    cfg = ag.schedule(x, {}).cfg
    rec["ag_path"], rec["ag_config"] = ag.last_path, repr(cfg)
    fns = {"ag_ours_us": lambda: ag(x, w13, ids, out=out_ag),
           "ag_user_us": lambda: ops.ag_user(x, w13, ids, out=out_ag),
           "ag_ours_sorted_us": lambda: ag(x, w13, ids, sorted_output=True, out=sorted_ag),
           "ag_nccl_us": nccl_ag,
           "ag_bound_us": _graph(rec, "ag_bound_us", lambda: torch._grouped_mm(rows_sorted, w13, offs=offs)),
           "ag_consumer_only_us": _graph(rec, "ag_consumer_only_us", consumer_alone(
               ctx, ag, cfg, gathered, w13, ids, bound_out))}
    _timed(ctx, rec, {k: f for k, f in fns.items() if f is not None}, iters, lead)
    rec["ag_user_path"], rec["ag_gemm"] = ops.ag_user.last_path, ag.last_gemm
    _replays(ctx, rec, {"ag_ours_graph_us": lambda: ag(x, w13, ids, out=out_ag), "ag_nccl_graph_us": nccl_ag},
             iters)

    # ---- grouped GEMM + combine + ReduceScatter
    out_rs = torch.empty(tokens, K, device=dev, dtype=bf)
    ref_rs = torch.empty_like(out_rs)
    h_sorted = h.view(P, nl)[routing.order]
    y_sorted = torch.empty(P, K, device=dev, dtype=bf)

    def nccl_rs():
        order = sort_by_expert(flat)
        y = torch._grouped_mm(h.view(P, nl)[order], w2, offs=expert_offsets(flat, E))
        # the top-k combine straight from the sorted rows: each row weighted, added into its token in float32
        acc = torch.zeros(T, K, device=dev, dtype=torch.float32)
        acc.index_add_(0, order // topk, y.float().mul_(weights.reshape(-1)[order].unsqueeze(-1)))
        reduce_scatter_rows(ref_rs, acc.to(bf))

    nccl_rs()
    rs(h, w2, ids, weights, out=out_rs)
    rec["rs_rel_err_vs_nccl"] = rel_err(out_rs, ref_rs)
    rs_cfg = rs.schedule(T, K, bf, {}).cfg
    rec["rs_path"], rec["rs_config"] = rs.last_path, repr(rs_cfg)
    fns = {"rs_ours_us": lambda: rs(h, w2, ids, weights, out=out_rs),
           "rs_user_us": lambda: ops.rs_user(h, w2, ids, weights, out=out_rs),
           "rs_ours_sorted_us": lambda: rs(h_sorted, w2, ids, weights, routing=routing, out=out_rs),
           "rs_nccl_us": nccl_rs,
           "rs_bound_us": _graph(rec, "rs_bound_us", lambda: torch._grouped_mm(h_sorted, w2, offs=offs)),
           "rs_consumer_only_us": _graph(rec, "rs_consumer_only_us", consumer_alone(
               ctx, ag, rs_cfg, h_sorted, w2, sorted_experts, y_sorted, contig=True))}
    _timed(ctx, rec, {k: f for k, f in fns.items() if f is not None}, iters, lead)
    rec["rs_user_path"], rec["rs_gemm"] = ops.rs_user.last_path, rs.last_gemm
    _replays(ctx, rec, {"rs_ours_graph_us": lambda: rs(h, w2, ids, weights, out=out_rs),
                        "rs_nccl_graph_us": nccl_rs}, iters)
    for op, flop in (("ag", 2 * P * K * 2 * nl), ("rs", 2 * P * nl * K)):
        for col in ("bound", "consumer_only"):
            us = rec.get(f"{op}_{col}_us")
            rec[f"{op}_{col}_tflops"] = None if not us else flop / us / 1e6


def bench_layer(ctx, rec, iters) -> None:
    """``layer_*``: TPMoE against torch_moe_layer on the same parameters, forward + backward and forward alone.
    "zipf": the inputs share a mean direction u, and the router's rows gain log(Zipf popularity) along u, so the
    logits lean towards popular experts (the measured imbalance in ``layer_imbalance``)."""
    from triton_overlap.nn import TPMoE

    E, topk, K, N, tokens, routing, lead_us = (rec[k] for k in ("E", "topk", "K", "N", "tokens_per_rank", "routing",
                                                                "lead_us"))
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)  # the replicated router: the same on every rank
    moe = TPMoE(K, N, E, topk, ctx=ctx, fallback="never")
    g = torch.Generator(device="cuda").manual_seed(2 + ctx.rank)
    x = torch.randn(tokens, K, device=dev, generator=g)
    if routing == "zipf":
        u = torch.nn.functional.normalize(torch.randn(K, device=dev, generator=torch.Generator(
            device="cuda").manual_seed(3)), dim=0)
        scale = 8.0
        x = x + scale * u
        bias = zipf_popularity(E, torch.Generator().manual_seed(0)).log().to(dev)
        with torch.no_grad():
            moe.router.weight.add_((bias / scale).unsqueeze(1) * u.unsqueeze(0))
    x = x.to(bf).requires_grad_()
    gy = torch.randn(tokens, K, device=dev, dtype=bf, generator=g)
    with torch.no_grad():
        ids, _ = moe.route(x)
        rec["layer_imbalance"] = load_imbalance(ids, E)
        rec["layer_rel_err_vs_torch"] = rel_err(moe(x), torch_moe_layer(x, moe.router.weight, moe.w13, moe.w2, topk))
    params = [moe.router.weight, moe.w13, moe.w2]

    def ours():
        moe(x).backward(gy)

    def theirs():
        torch_moe_layer(x, *params, topk).backward(gy)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    _timed(ctx, rec, {"layer_ours_us": ours, "layer_torch_us": theirs}, iters, lead_us)
    _timed(ctx, rec, {"layer_ours_fwd_us": fwd(lambda: moe(x)),
                      "layer_torch_fwd_us": fwd(lambda: torch_moe_layer(x, *params, topk))}, iters, lead_us)
    for p in params + [x]:
        p.grad = None


__all__ = ["MODELS", "MOE_SHAPES", "bench_moe", "consumer_alone", "load_imbalance", "parse_shape", "routing_ids",
           "torch_moe_layer"]
