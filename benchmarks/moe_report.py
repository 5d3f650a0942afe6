"""The MoE benchmark's report (benchmarks/moe.py): ``moe-<gpu>x<W>.{json,md}`` in report.py's style, the JSON with
the commit and date it was measured on (report.provenance), the Markdown a table per op and the geometric means
against the issue's targets."""
from __future__ import annotations

import json
import os

from report import geomean, provenance, ratio_text, us_text

MOE_HEADER = ("| model | tokens/rank | routing | max/mean load | "
              "AG ours µs | AG sorted µs | AG user µs | AG NCCL µs | AG bound µs | AG consumer µs | AG vs NCCL | "
              "AG / bound | AG consumer vs bound | "
              "RS ours µs | RS sorted µs | RS user µs | RS NCCL µs | RS bound µs | RS consumer µs | RS vs NCCL | "
              "RS / bound | RS consumer vs bound | "
              "layer fwd+bwd ours µs | layer fwd+bwd torch µs | layer vs torch | layer fwd ours µs | "
              "layer fwd torch µs |\n|" + "---|" * 27)
# AG: ag_moe_gemm, x [T/W, K] -> [T, k, 2N/W] token-major (ours: overlap, routing checks off; sorted: into the
# expert-sorted layout; user: fallback="auto" and routing checked); NCCL: all_gather + sort + torch._grouped_mm +
# scatter back; bound: torch._grouped_mm alone on the gathered sorted rows; consumer: our grouped GEMM alone on them.
# RS: moe_gemm_rs, h [T, k, N/W] -> [T/W, K]; NCCL: sort + torch._grouped_mm + combine + reduce_scatter; bound and
# consumer: the grouped GEMM alone (no combine; ours reads the sorted rows by TMA, as moe_gemm_rs on the sorted
# layout). vs NCCL: NCCL / ours; / bound: ours / bound; consumer vs bound: bound / consumer. layer: TPMoE against
# the same layer in torch autograd over NCCL and torch._grouped_mm.


def moe_row(r: dict) -> str:
    cols = [r["model"], str(r["tokens_per_rank"]), r["routing"], f"{r['imbalance']:.2f}"]
    for op in ("ag", "rs"):
        g = lambda k: r.get(f"{op}_{k}_us")  # noqa: E731
        user = us_text(g("user")) + (" (NCCL)" if r.get(f"{op}_user_path") == "fallback" else "")
        cols += [us_text(g("ours")), us_text(g("ours_sorted")), user,
                 us_text(g("nccl")), us_text(g("bound")), us_text(g("consumer_only")), ratio_text(g("nccl"), g("ours")),
                 ratio_text(g("ours"), g("bound"), ""), ratio_text(g("bound"), g("consumer_only"), "")]
    cols += [us_text(r.get("layer_ours_us")), us_text(r.get("layer_torch_us")),
             ratio_text(r.get("layer_torch_us"), r.get("layer_ours_us")), us_text(r.get("layer_ours_fwd_us")),
             us_text(r.get("layer_torch_fwd_us"))]
    return "| " + " | ".join(cols) + " |"


def summary(records) -> dict:
    """Geometric means over the records: each op's and the layer's speed-up over the NCCL baseline, ours over the
    bound, and our grouped GEMM alone against torch._grouped_mm (the issue's targets: >= 1.25x, >= 1.15x for the
    layer, within 1.10x of the bound, >= 0.95x)."""
    out = {}
    for op in ("ag", "rs"):
        out[f"{op}_vs_nccl"] = geomean(r.get(f"{op}_nccl_us") / r[f"{op}_ours_us"] for r in records
                                        if r.get(f"{op}_nccl_us") and r.get(f"{op}_ours_us"))
        out[f"{op}_vs_bound"] = geomean(r[f"{op}_ours_us"] / r[f"{op}_bound_us"] for r in records
                                         if r.get(f"{op}_ours_us") and r.get(f"{op}_bound_us"))
        out[f"{op}_consumer_vs_grouped_mm"] = geomean(
            r[f"{op}_bound_us"] / r[f"{op}_consumer_only_us"] for r in records
            if r.get(f"{op}_bound_us") and r.get(f"{op}_consumer_only_us"))
    out["layer_vs_torch"] = geomean(r["layer_torch_us"] / r["layer_ours_us"] for r in records
                                     if r.get("layer_torch_us") and r.get("layer_ours_us"))
    return out


SUMMARY_LINES = [("ag_vs_nccl", "ag_moe_gemm over NCCL + torch._grouped_mm (target >= 1.25x)"),
                 ("rs_vs_nccl", "moe_gemm_rs over torch._grouped_mm + NCCL (target >= 1.25x)"),
                 ("layer_vs_torch", "TPMoE forward + backward over the torch layer (target >= 1.15x)"),
                 ("ag_vs_bound", "ag_moe_gemm / bound (target <= 1.10)"),
                 ("rs_vs_bound", "moe_gemm_rs / bound (target <= 1.10)"),
                 ("ag_consumer_vs_grouped_mm", "our grouped GEMM alone vs torch._grouped_mm, AG shapes (target "
                                               ">= 0.95)"),
                 ("rs_consumer_vs_grouped_mm", "our grouped GEMM alone vs torch._grouped_mm, RS shapes (target "
                                               ">= 0.95)")]


def write_moe(records, W, out_dir: str, pending=()) -> dict:
    """``moe-<gpu>x<W>[-<N>hosts].{json,md,png}`` in ``out_dir`` (``pending``: the run's shapes not measured yet);
    returns the summary (geometric means)."""
    os.makedirs(out_dir, exist_ok=True)
    hosts = records[0].get("num_hosts", 1)
    base = os.path.join(out_dir, f"moe-{records[0]['gpu']}x{W}" + (f"-{hosts}hosts" if hosts > 1 else ""))
    geo = summary(records)
    doc = {"op": "moe", "world_size": W, **provenance(), "summary": geo, "records": records}
    if pending:
        doc["not_measured"] = [list(s) if isinstance(s, (tuple, list)) else s for s in pending]
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    lead = records[0].get("lead_us", 0)
    with open(base + ".md", "w") as f:
        f.write(f"Measured on commit {doc['commit']}, {doc['date']} (torch {doc['torch']}, "
                f"triton {doc['triton']}).\n\n")
        f.write(f"moe, {records[0]['gpu']} x{W}, bf16, median µs (max over ranks), each op's columns and the layer's "
                f"timed in turns within each iteration; bound and consumer alone as CUDA-graph replays (GPU time); "
                f"before each timed call the ranks are lined up on the device and the host is ahead ({lead:.0f} µs "
                f"spins around the aligning all_reduce). Models (E, top-k, K, N): "
                + "; ".join(f"{r['model']} ({r['E']}, {r['topk']}, {r['K']}, {r['N']})"
                            for r in {r["model"]: r for r in records}.values())
                + f"; Zipf exponent {records[0].get('zipf_exponent')}.\n\n{MOE_HEADER}\n")
        f.write("\n".join(moe_row(r) for r in records) + "\n\n")
        for key, text in SUMMARY_LINES:
            if geo.get(key) is not None:
                f.write(f"geometric mean, {text}: {geo[key]:.3f}\n")
        graphs = [(r["ag_nccl_graph_us"] / r["ag_ours_graph_us"], r["rs_nccl_graph_us"] / r["rs_ours_graph_us"])
                  for r in records if all(r.get(k) for k in ("ag_nccl_graph_us", "ag_ours_graph_us",
                                                             "rs_nccl_graph_us", "rs_ours_graph_us"))]
        if graphs:
            f.write(f"geometric mean over NCCL, both in CUDA graphs: ag_moe_gemm "
                    f"{geomean(a for a, _ in graphs):.3f}, moe_gemm_rs {geomean(b for _, b in graphs):.3f}\n")
        if pending:
            shapes = "; ".join(",".join(map(str, s)) if isinstance(s, (tuple, list)) else str(s) for s in pending)
            f.write(f"\nNot measured in this run (it ended before them): {shapes}.\n")
        notes = [f"- {r['model']} {r['tokens_per_rank']} {r['routing']}: {r['note']}" for r in records if r["note"]]
        if notes:
            f.write("\nnotes:\n" + "\n".join(notes) + "\n")
    plot(records, base)
    return geo


def plot(records, base: str) -> None:
    """``base``.png: per shape, NCCL's time over ours for each op (above 1: ours is faster), where matplotlib is
    installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['model']}\n{r['tokens_per_rank']} {r['routing']}" for r in records]
    fig, ax = plt.subplots(figsize=(max(6, len(records)), 4))
    for i, (op, name) in enumerate((("ag", "ag_moe_gemm"), ("rs", "moe_gemm_rs"), ("layer", "layer fwd+bwd"))):
        ours, nccl = (f"{op}_ours_us", f"{op}_nccl_us") if op != "layer" else ("layer_ours_us", "layer_torch_us")
        ax.bar([x + 0.27 * i for x in range(len(records))],
               [r[nccl] / r[ours] if r.get(nccl) and r.get(ours) else 0 for r in records], width=0.27, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.27 for x in range(len(records))], labels, fontsize=7)
    ax.set_ylabel("NCCL baseline / ours (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=100)
    plt.close(fig)


__all__ = ["MOE_HEADER", "moe_row", "plot", "summary", "write_moe"]
