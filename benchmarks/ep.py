"""Expert-parallel benchmark (``bench.py ep``): dispatch, combine and the MoE layer, ours against the same exchange
through ``torch.distributed.all_to_all_single`` (NCCL).

    bash scripts/launch.sh benchmarks/bench.py ep [--shapes deepseek-v3,4096,zipf ...]

Per shape (model, tokens per rank, routing), in one process group and one run:

* **dispatch**: ``ExpertParallel.dispatch`` overlapped (copy engines, a flag per source) against the op with
  ``fallback="always"``, which moves the same records, rows and metadata through ``all_to_all_single`` into the same
  layouts (both return equal tensors; the benchmark checks it). Rank r's tokens are its slice of one seeded draw of
  ``tuning.moe_routing_ids`` over all ranks' tokens, so every rank sees the same traffic matrix.
* **combine**: ``ExpertParallel.combine`` of the dispatched rows (as the experts' outputs) on both paths; both return
  the same bits (the sums walk their terms in one fixed order), checked.
* **layer**: ``nn.EPMoE`` forward + backward with ``fallback="never"`` against the same parameters with
  ``fallback="always"`` (NCCL all_to_all_single for every exchange), the experts' GEMMs ``torch._grouped_mm`` in
  both; and the forward alone on both, with ``experts_gemm="overlap"`` (the first GEMM started on each source's
  rows as they land, ops.ep_experts) and with ``combine_stages=4`` (the down projection in four launches, each
  stage's partials sent as it ends, ops.ep_combine).
* **GB/s**: the bytes of rows the busiest rank sends to other ranks (dispatch: H-wide rows, once per (token, owner);
  combine: the partials back) over the call's time. The bound from the peers' measured copy bandwidth is not
  measured here.

Timings as the other benchmarks: CUDA events around each call, the ranks lined up before it, median over
iterations, max over ranks, the columns in turns (timing.time_interleaved). Not timed: fp8 dispatch (rows of
float8_e4m3fn with their scales); not built: the low-latency mode. Writes ``ep-<gpu>x<W>.{json,md}``
(ep_report.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

import triton_overlap as to
from ep_report import ep_row
from triton_overlap.nn import EPMoE
from triton_overlap.timing import time_interleaved
from triton_overlap.torchrun import say
from triton_overlap.tuning import MOE_ROUTINGS as ROUTINGS, ZIPF_EXPONENT
from triton_overlap.tuning import moe_routing_ids as routing_ids

#: name -> (experts, top-k, hidden H of the exchanged rows, expert hidden width of the layer's SwiGLU)
MODELS = {"deepseek-v3": (256, 8, 7168, 2048), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TOKENS_PER_RANK = (4096,)
EP_SHAPES = [(m, t, r) for m in MODELS for t in TOKENS_PER_RANK for r in ROUTINGS]
BUDGET_S = 2.0  # seconds of timed calls per column at most (time_interleaved's budget_s)
COMBINE_STAGES = 4  # the staged layer's ExpertParallelConfig.combine_stages


def parse_shape(text: str) -> tuple:
    """``"model,tokens_per_rank,routing"`` (``--shapes`` of ``bench.py ep``) -> a shape of EP_SHAPES' form."""
    model, tokens, routing = text.split(",")
    if model not in MODELS or routing not in ROUTINGS:
        raise ValueError(f"ep shape: model one of {sorted(MODELS)}, routing one of {ROUTINGS}, not {text!r}")
    return model, int(tokens), routing


def rank_routing(ctx, tokens: int, E: int, topk: int, routing: str):
    """This rank's (ids int64 [tokens, topk], weights float32 [tokens, topk]): its slice of one seeded draw over
    every rank's tokens (the same draw on every rank), weights a seeded softmax."""
    ids = routing_ids(tokens * ctx.world_size, E, topk, routing)[ctx.rank * tokens:(ctx.rank + 1) * tokens]
    g = torch.Generator().manual_seed(10 + ctx.rank)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), dim=-1)
    return ids.to(ctx.device), weights.to(ctx.device)


def record(ctx, model: str, tokens: int, routing: str, gpu: str, lead_us: float) -> dict:
    E, topk, H, hidden = MODELS[model]
    return {"model": model, "E": E, "topk": topk, "H": H, "hidden": hidden, "tokens_per_rank": tokens,
            "routing": routing, "world_size": ctx.world_size, "gpu": gpu, "dtype": "bfloat16", "note": "",
            "lead_us": lead_us, "zipf_exponent": ZIPF_EXPONENT}


def exchange_case(ctx, ops, rec) -> dict:
    """The dispatch and combine columns' functions for ``rec``'s shape, after one call of each path, checked equal
    (rec gains ``dispatch_equal``, ``combine_equal``, the rows this rank sent and received, the busiest rank's bytes).
    Runs on every backend (the host's too): no timing here."""
    E, topk, H, tokens = rec["E"], rec["topk"], rec["H"], rec["tokens_per_rank"]
    torch.manual_seed(ctx.rank)
    x = torch.randn(tokens, H, device=ctx.device).to(torch.bfloat16)
    ids, weights = rank_routing(ctx, tokens, E, topk, rec["routing"])

    def dispatch(op):
        return op.dispatch(x, ids, weights, num_experts=E)

    d, d_ref = dispatch(ops.ours), dispatch(ops.nccl)
    fields = ("tokens", "counts", "offsets", "source", "token", "weights", "slots", "slot_weights", "positions")
    rec["dispatch_equal"] = all(torch.equal(getattr(d, f), getattr(d_ref, f)) for f in fields)
    out, out_ref = ops.ours.combine(d.tokens, d), ops.nccl.combine(d_ref.tokens, d_ref)
    rec["combine_equal"] = bool(torch.equal(out, out_ref))
    rec["rows_received"], rec["rows_sent_to_peers"] = d.num_rows, sum(d.sent) - d.sent[ctx.rank]
    busiest = torch.tensor([rec["rows_sent_to_peers"], sum(d.received) - d.received[ctx.rank]], dtype=torch.float64,
                           device=ctx.device)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    rec["dispatch_bytes"], rec["combine_bytes"] = (float(v) * H * 2 for v in busiest.tolist())
    rec["path"] = ops.ours.last_path
    return {"dispatch_ours_us": lambda: dispatch(ops.ours), "dispatch_nccl_us": lambda: dispatch(ops.nccl),
            "combine_ours_us": lambda: ops.ours.combine(d.tokens, d, out=out),
            "combine_nccl_us": lambda: ops.nccl.combine(d_ref.tokens, d_ref, out=out_ref)}


def layer_case(ctx, rec) -> dict:
    """The layer's columns: EPMoE forward + backward on the overlapped path and on all_to_all_single, the same
    parameters (rec gains the relative error between the two outputs), and the forward alone on both and with
    ``experts_gemm="overlap"`` (the gate and up projections started on each source's rows as they land:
    ``layer_overlap_gemm`` names the kernel) and with ``combine_stages=COMBINE_STAGES`` (the down projection in
    stages, each stage's partials sent as it ends; rec gains its output's relative error against ours)."""
    E, topk, H, hidden, tokens = (rec[k] for k in ("E", "topk", "H", "hidden", "tokens_per_rank"))
    torch.manual_seed(0)  # the replicated router: the same on every rank
    ours = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="never")
    theirs = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="always")
    per_source = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="never", experts_gemm="overlap")
    staged = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="never", combine_stages=COMBINE_STAGES)
    for m in (theirs, per_source, staged):
        m.load_state_dict(ours.state_dict())
    g = torch.Generator(device=ctx.device).manual_seed(2 + ctx.rank)
    x = torch.randn(tokens, H, device=ctx.device, generator=g).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(tokens, H, device=ctx.device, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        a, b = ours(x), theirs(x)
        rec["layer_rel_err"] = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        per_source(x)
        c = staged(x)
        rec["layer_staged_rel_err"] = float((c.float() - a.float()).norm() / a.float().norm().clamp_min(1e-30))
    rec["layer_path"], rec["layer_overlap_gemm"] = ours.last_path, per_source.op.last_gemm
    rec["combine_stages"] = COMBINE_STAGES

    def step(m):
        def run():
            m.zero_grad(set_to_none=True)
            x.grad = None
            m(x).backward(gy)
        return run

    def forward(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    return {"layer_ours_us": step(ours), "layer_nccl_us": step(theirs), "layer_fwd_ours_us": forward(ours),
            "layer_fwd_overlap_us": forward(per_source), "layer_fwd_staged_us": forward(staged),
            "layer_fwd_nccl_us": forward(theirs)}


def _timed(ctx, rec, fns, iters, lead_us) -> None:
    ctx.check()
    rec.update(time_interleaved(fns, iters, budget_s=BUDGET_S, lead_us=lead_us))
    ctx.check()


def bench_ep(ctx, shapes, iters, write_partial, gpu: str, lead_us: float) -> list[dict]:
    """One record per shape (EP_SHAPES' form), ``write_partial(records)`` after each."""
    ops = SimpleNamespace(ours=to.ExpertParallel(ctx, fallback="never", name="bench.ep"),
                          nccl=to.ExpertParallel(ctx, fallback="always", name="bench.ep.nccl"))
    records = []
    for model, tokens, routing in shapes:
        rec = record(ctx, model, tokens, routing, gpu, lead_us)
        _timed(ctx, rec, exchange_case(ctx, ops, rec), iters, lead_us)
        for k in ("dispatch", "combine"):
            us = rec.get(f"{k}_ours_us")
            rec[f"{k}_ours_gbps"] = rec[f"{k}_bytes"] / us / 1e3 if us else None
        torch.cuda.empty_cache()
        _timed(ctx, rec, layer_case(ctx, rec), iters, lead_us)
        torch.cuda.empty_cache()
        records.append(rec)
        write_partial(records)
        say(ep_row(rec))
    return records


__all__ = ["EP_SHAPES", "MODELS", "bench_ep", "exchange_case", "layer_case", "parse_shape", "rank_routing", "record"]
