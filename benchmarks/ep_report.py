"""The expert-parallel benchmark's report (benchmarks/ep.py): ``ep-<gpu>x<W>.{json,md}`` in report.py's style, the
JSON with the commit and date it was measured on (report.provenance), the Markdown one table and the geometric
means against the issue's targets."""
from __future__ import annotations

from report import geomean, ratio_text, us_text, write_table

EP_HEADER = ("| model | tokens/rank | routing | dispatch ours µs | dispatch NCCL µs | dispatch vs NCCL | "
             "dispatch GB/s | combine ours µs | combine NCCL µs | combine vs NCCL | combine GB/s | "
             "layer fwd+bwd ours µs | layer fwd+bwd NCCL µs | layer vs NCCL | layer fwd ours µs | "
             "layer fwd NCCL µs | fwd vs NCCL | layer fwd, first GEMM per source µs | per source vs ours | "
             "its kernel | layer fwd, down projection in stages µs | staged vs ours | equal to NCCL's |\n|"
             + "---|" * 23)
# dispatch / combine: ExpertParallel overlapped against the same exchange through all_to_all_single (its
# fallback="always"); GB/s: the busiest rank's bytes to its peers over ours' time; layer: EPMoE forward + backward on
# both paths; layer fwd: the forward alone, ours, NCCL, and ours with experts_gemm="overlap" (the gate/up GEMM
# started on each source's rows as they land; its kernel), and with the down projection in combine_stages launches,
# each stage's partials sent as it ends; equal: the dispatched rows and the combined output bit-equal between the
# two paths.


def ep_row(r: dict) -> str:
    cols = [r["model"], str(r["tokens_per_rank"]), r["routing"]]
    for k in ("dispatch", "combine"):
        gbps = r.get(f"{k}_ours_gbps")
        cols += [us_text(r.get(f"{k}_ours_us")), us_text(r.get(f"{k}_nccl_us")),
                 ratio_text(r.get(f"{k}_nccl_us"), r.get(f"{k}_ours_us")), "n/a" if gbps is None else f"{gbps:.0f}"]
    cols += [us_text(r.get("layer_ours_us")), us_text(r.get("layer_nccl_us")),
             ratio_text(r.get("layer_nccl_us"), r.get("layer_ours_us")),
             us_text(r.get("layer_fwd_ours_us")), us_text(r.get("layer_fwd_nccl_us")),
             ratio_text(r.get("layer_fwd_nccl_us"), r.get("layer_fwd_ours_us")),
             us_text(r.get("layer_fwd_overlap_us")),
             ratio_text(r.get("layer_fwd_ours_us"), r.get("layer_fwd_overlap_us")),
             r.get("layer_overlap_gemm") or "n/a",
             us_text(r.get("layer_fwd_staged_us")),
             ratio_text(r.get("layer_fwd_ours_us"), r.get("layer_fwd_staged_us")),
             "yes" if r.get("dispatch_equal") and r.get("combine_equal") else "NO"]
    return "| " + " | ".join(cols) + " |"


def summary(records) -> dict:
    """Geometric means over the records of NCCL's time over ours: dispatch, combine (target >= 1.5x each) and the
    layer (target >= 1.3x at W = 4 and 8); a record whose two paths returned different tensors is left out."""
    same = [r for r in records if r.get("dispatch_equal") and r.get("combine_equal")]
    return {f"{k}_vs_nccl": geomean(r[f"{k}_nccl_us"] / r[f"{k}_ours_us"] for r in same
                                     if r.get(f"{k}_nccl_us") and r.get(f"{k}_ours_us"))
            for k in ("dispatch", "combine", "layer")}


SUMMARY_LINES = [("dispatch_vs_nccl", "dispatch over all_to_all_single (target >= 1.5x)"),
                 ("combine_vs_nccl", "combine over all_to_all_single (target >= 1.5x)"),
                 ("layer_vs_nccl", "EPMoE forward + backward over all_to_all_single (target >= 1.3x at W = 4, 8)")]


def write_ep(records, W, out_dir: str, pending=()) -> dict:
    """``ep-<gpu>x<W>[-<N>hosts].{json,md}`` in ``out_dir`` (``pending``: the run's shapes not measured yet); returns
    the summary (geometric means)."""
    geo = summary(records)
    lead = records[0].get("lead_us", 0)
    caption = (f"bf16 rows, median µs (max over ranks), the columns timed in turns within each iteration; before "
               f"each timed call the ranks are lined up on the device and the host is ahead ({lead:.0f} µs spins "
               f"around the aligning all_reduce). Models (E, top-k, H, expert hidden): "
               + "; ".join(f"{r['model']} ({r['E']}, {r['topk']}, {r['H']}, {r['hidden']})"
                           for r in {r["model"]: r for r in records}.values())
               + f"; Zipf exponent {records[0].get('zipf_exponent')}. NCCL: the same exchange through "
               "all_to_all_single (the op's fallback path).")
    footer = "".join(f"geometric mean, {text}: {geo[key]:.3f}\n" for key, text in SUMMARY_LINES
                     if geo.get(key) is not None)
    footer += ("The layer's outputs, ours against all_to_all_single's (relative error): "
               + ", ".join(f"{r['model']} {r['routing']} {r['layer_rel_err']:.1e}" for r in records
                           if r.get("layer_rel_err") is not None)
               + "; records whose paths differ (NO) are left out of the means.\n")
    write_table("ep", records, W, out_dir, caption, EP_HEADER, ep_row,
                lambda r: f"{r['model']} {r['tokens_per_rank']} {r['routing']}", pending, footer, {"summary": geo})
    return geo


__all__ = ["EP_HEADER", "ep_row", "summary", "write_ep"]
