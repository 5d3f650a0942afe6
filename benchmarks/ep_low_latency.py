"""Expert-parallel low-latency benchmark (``bench.py ep_ll``): decode-sized dispatch and combine in CUDA graphs.

    bash scripts/launch.sh benchmarks/bench.py ep_ll [--shapes deepseek-v3,128,bf16 ...]

Per shape (model, tokens per rank, rows bf16 or fp8 with 128-wide groups' scales), in one process group and one run,
the columns timed in turns (timing.time_interleaved, CUDA events, median, max over ranks):

* **low-latency**: ``ExpertParallelLowLatency`` (``max_tokens_per_rank`` = the tokens per rank) captured in a CUDA
  graph, each replay one call: dispatch alone, combine alone (of one dispatch's rows, as the experts' outputs), and
  dispatch + combine in one graph.
* **EPMoE** (DeepSeek-V3's expert width, bf16 rows only): the layer's forward without autograd with
  ``max_tokens_per_rank`` (the low-latency mode) in a CUDA graph, against the same layer on the normal mode, eager.
* **normal mode** (``ExpertParallel``, copy engines, one host synchronisation per dispatch) and **NCCL** (the same
  exchange through ``all_to_all_single``, the normal op's fallback), eager: what a decode step without the
  low-latency mode would call; they cannot be captured (the host reads the counts).

Reference figures for the same shape (hidden 7168, top-8, 128 tokens per rank, fp8 dispatch), all at EP8: DeepEP's
low-latency mode 77 / 114 µs dispatch / combine (RDMA), pplx-kernels 83.6 / 102.3 µs (NVLink), Triton-distributed
about 76 / 126 µs (8×H800). Writes ``ep_low_latency-<gpu>x<W>.{json,md}``.
"""
from __future__ import annotations

import torch

import triton_overlap as to
from ep import MODELS, rank_routing
from report import ratio_text, us_text, write_table
from triton_overlap.timing import capture, time_interleaved
from triton_overlap.torchrun import say

TOKENS = (1, 32, 128)
EP_LL_SHAPES = [("deepseek-v3", t, rows) for rows in ("bf16", "fp8") for t in TOKENS]
COLUMNS = ("ll_dispatch_us", "ll_combine_us", "ll_round_trip_us", "normal_dispatch_us", "normal_combine_us",
           "nccl_dispatch_us", "nccl_combine_us", "layer_ll_us", "layer_normal_us")
EP_LL_HEADER = ("| model | tokens/rank | rows | dispatch µs | combine µs | dispatch + combine µs | normal dispatch "
                "µs | normal combine µs | NCCL dispatch µs | NCCL combine µs | EPMoE decode µs | EPMoE normal µs | "
                "dispatch + combine vs NCCL | EPMoE decode vs normal |\n|" + "---|" * 14)


def parse_shape(text: str) -> tuple:
    """``"model,tokens_per_rank,bf16|fp8"`` -> a shape of EP_LL_SHAPES' form."""
    model, tokens, rows = text.split(",")
    if model not in MODELS or rows not in ("bf16", "fp8"):
        raise ValueError(f"ep_ll shape: model one of {sorted(MODELS)}, rows bf16 or fp8, not {text!r}")
    return model, int(tokens), rows


def row(r: dict) -> str:
    nccl = (r.get("nccl_dispatch_us") or 0) + (r.get("nccl_combine_us") or 0)
    cols = [r["model"], str(r["tokens_per_rank"]), r["rows"]] + [us_text(r.get(c)) for c in COLUMNS]
    cols += [ratio_text(nccl or None, r.get("ll_round_trip_us")), ratio_text(r.get("layer_normal_us"),
                                                                             r.get("layer_ll_us"))]
    return "| " + " | ".join(cols) + " |"


def layer_columns(ctx, rec) -> dict:
    """EPMoE's forward without autograd (router, dispatch, SwiGLU experts by torch._grouped_mm, combine) on the
    low-latency mode in a CUDA graph and on the normal mode eager (rec gains their outputs' relative difference)."""
    from triton_overlap.nn import EPMoE

    E, topk, H, hidden, tokens = (rec[k] for k in ("E", "topk", "H", "hidden", "tokens_per_rank"))
    torch.manual_seed(0)
    decode = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="never", max_tokens_per_rank=tokens)
    plain = EPMoE(H, hidden, E, topk, ctx=ctx, fallback="never")
    plain.load_state_dict(decode.state_dict())
    x = torch.randn(tokens, H, device=ctx.device).to(torch.bfloat16)
    with torch.no_grad():
        a, b = decode(x), plain(x)
        rec["layer_rel_err"] = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        graph = capture(lambda: decode(x))

    def normal():
        with torch.no_grad():
            plain(x)

    return {"layer_ll_us": graph.replay, "layer_normal_us": normal}


def bench_ep_low_latency(ctx, shapes, iters, write_partial, gpu: str, lead_us: float) -> list[dict]:
    records = []
    for model, tokens, rows in shapes:
        E, topk, H, hidden = MODELS[model]
        rec = {"model": model, "E": E, "topk": topk, "H": H, "hidden": hidden, "tokens_per_rank": tokens, "rows": rows,
               "world_size": ctx.world_size, "gpu": gpu, "lead_us": lead_us, "routing": "balanced", "note": ""}
        torch.manual_seed(ctx.rank)
        x = torch.randn(tokens, H, device=ctx.device).to(torch.bfloat16)
        scales = None
        if rows == "fp8":
            x = x.to(torch.float8_e4m3fn)
            scales = torch.rand(tokens, H // 128, device=ctx.device) + 0.5
        ids, weights = rank_routing(ctx, tokens, E, topk, "balanced")
        ll = to.ExpertParallelLowLatency(ctx, tokens, fallback="never", name=f"bench.ep_ll.{tokens}")
        normal = to.ExpertParallel(ctx, fallback="never", name="bench.ep")
        nccl = to.ExpertParallel(ctx, fallback="always", name="bench.ep.nccl")

        def dispatch(op):
            return op.dispatch(x, ids, weights, num_experts=E, scales=scales)

        d, dn, dr = dispatch(ll), dispatch(normal), dispatch(nccl)
        y = torch.zeros(d.num_rows, H, dtype=torch.bfloat16, device=ctx.device)
        yn = torch.randn(dn.num_rows, H, device=ctx.device).to(torch.bfloat16)  # the experts' outputs
        n = int(d.offsets[-1])
        y[:n] = yn
        rec["combine_equal"] = bool(torch.equal(ll.combine(y, d), nccl.combine(yn, dr)))
        graphs = {"ll_dispatch_us": capture(lambda: dispatch(ll)), "ll_combine_us": capture(lambda: ll.combine(y, d)),
                  "ll_round_trip_us": capture(lambda: ll.combine(y, dispatch(ll)))}
        fns = {k: g.replay for k, g in graphs.items()}
        fns.update(normal_dispatch_us=lambda: dispatch(normal), normal_combine_us=lambda: normal.combine(yn, dn),
                   nccl_dispatch_us=lambda: dispatch(nccl), nccl_combine_us=lambda: nccl.combine(yn, dr))
        if rows == "bf16":
            fns.update(layer_columns(ctx, rec))
        ctx.check()
        rec.update(time_interleaved(fns, iters, lead_us=lead_us))
        ctx.check()
        del graphs, fns
        torch.cuda.empty_cache()
        records.append(rec)
        say(row(rec))
        write_partial(records)
    return records


def write_ep_low_latency(records, W, out_dir: str, pending=()) -> None:
    lead = records[0].get("lead_us", 0)
    caption = (f"median µs (max over ranks), the columns timed in turns; low-latency columns: one call per CUDA-graph "
               f"replay; normal mode and NCCL (all_to_all_single): eager, {lead:.0f} µs of host lead. Balanced "
               "routing; fp8 rows with H/128 float32 scales. EPMoE: router, dispatch, SwiGLU experts by "
               "torch._grouped_mm, combine, without autograd. The combine's output equal to NCCL's: "
               + ", ".join(f"{r['tokens_per_rank']} {r['rows']} {'yes' if r.get('combine_equal') else 'NO'}"
                           for r in records) + "; the decode layer's output against the normal mode's (relative "
               "difference): " + ", ".join(f"{r['tokens_per_rank']} {r['layer_rel_err']:.1e}" for r in records
                                           if r.get("layer_rel_err") is not None) + ".")
    write_table("ep_low_latency", records, W, out_dir, caption, EP_LL_HEADER, row,
                lambda r: f"{r['model']} {r['tokens_per_rank']} {r['rows']}", pending, "", {})


__all__ = ["EP_LL_HEADER", "EP_LL_SHAPES", "bench_ep_low_latency", "parse_shape", "row", "write_ep_low_latency"]
