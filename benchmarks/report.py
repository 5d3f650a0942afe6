"""The benchmarks' report writer: one JSON (with the commit and date it was measured on), a Markdown table and a
plot per op, GPU and world size: ``<op>-<gpu>x<W>.{json,md,png}``."""
from __future__ import annotations

import datetime
import json
import math
import os
import subprocess

import torch
import triton


def provenance() -> dict:
    """What a result was measured on: the commit (``TRITON_OVERLAP_COMMIT``, else ``git rev-parse HEAD``, with
    ``+changes`` when the working tree differs from it), the date, torch, triton and the GPU."""
    commit = os.environ.get("TRITON_OVERLAP_COMMIT")
    if not commit:
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                    check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True).stdout.strip()
            commit += "+changes" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"commit": commit, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def geomean(values):
    """The geometric mean of the values that are set (None and 0 left out); None where none is."""
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def us_text(v) -> str:
    """µs as a table cell: one decimal, "n/a" where not measured."""
    return "n/a" if v is None else f"{v:.1f}"


def ratio_text(a, b, suffix="x") -> str:
    """``a / b`` as a table cell with two decimals and ``suffix``, "n/a" where either is missing."""
    return "n/a" if not a or not b else f"{a / b:.2f}{suffix}"


def save_json(base: str, op: str, world: int, records: list, pending=(), extra: dict | None = None) -> None:
    """``base``.json: the op, world size, provenance, ``extra`` (a summary, say), the records and the shapes still
    ``pending``."""
    doc = {"op": op, "world_size": world, **provenance(), **(extra or {}), "records": records}
    if pending:
        doc["not_measured"] = [list(s) if isinstance(s, (tuple, list)) else s for s in pending]
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)


def measured(base: str) -> str:
    with open(base + ".json") as f:
        doc = json.load(f)
    return f"Measured on commit {doc['commit']}, {doc['date']} (torch {doc['torch']}, triton {doc['triton']}).\n\n"


CP_HEADER = ("| B | S | Hq | Hkv | D | dtype | causal | docs | ours µs | ours, no replay µs | "
             "host µs, no replay / replayed | "
             "NCCL all_gather + kernel µs | speed-up vs NCCL | NCCL all_gather alone µs | kernel on gathered K/V µs | "
             "NCCL / kernel on gathered (ceiling) | "
             "ours, graph µs | NCCL + kernel, graph µs | speed-up, graphs | "
             "SDPA flash, 1 GPU, full S µs | our kernel, 1 GPU, full S µs | kernel alone, local µs | "
             "TFLOP/s per GPU | efficiency | fwd+bwd ours µs | fwd+bwd, K/V kept µs | fwd+bwd NCCL µs | "
             "fwd+bwd speed-up vs NCCL | fwd+bwd SDPA 1 GPU µs | fwd+bwd efficiency | held for bwd MiB | "
             "held, K/V kept MiB | SDPA cuDNN, 1 GPU, full S µs | efficiency vs cuDNN | fwd+bwd cuDNN 1 GPU µs | "
             "fwd+bwd efficiency vs cuDNN |\n|" + "---|" * 36)


def _cp_row(r):
    f = lambda x, d=1: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    return (f"| {r['B']} | {r['S']} | {r['Hq']} | {r['Hkv']} | {r['D']} | {r.get('dtype', 'bf16')} | {r['causal']} | "
            f"{r.get('docs') or '-'} | "
            f"{r['ours_us']:.1f} | "
            f"{f(r.get('ours_no_replay_us'))} | {f(r.get('host_no_replay_us'))} / {f(r.get('host_replay_us'))} | "
            f"{f(r['nccl_ag_us'])} | {ratio(r['nccl_ag_us'], r['ours_us'])} | {f(r.get('gather_us'))} | "
            f"{f(r.get('kernel_gathered_us'))} | {f(r.get('nccl_ceiling'), 3)} | {f(r.get('ours_graph_us'))} | "
            f"{f(r.get('nccl_ag_graph_us'))} | {ratio(r.get('nccl_ag_graph_us'), r.get('ours_graph_us'))} | "
            f"{f(r['single_gpu_us'])} | {r['kernel_full_us']:.1f} | {r['kernel_only_us']:.1f} | "
            f"{r['tflops_per_gpu']:.0f} | {f(r['efficiency'], 2)} | {r['fwd_bwd_ours_us']:.1f} | "
            f"{f(r.get('fwd_bwd_keep_kv_us'))} | {f(r.get('fwd_bwd_nccl_ag_us'))} | "
            f"{ratio(r.get('fwd_bwd_nccl_ag_us'), r['fwd_bwd_ours_us'])} | "
            f"{f(r['fwd_bwd_single_gpu_us'])} | {f(r['fwd_bwd_efficiency'], 2)} | {f(r.get('saved_mib'), 0)} | "
            f"{f(r.get('saved_keep_kv_mib'), 0)} | {f(r.get('cudnn_us'))} | {f(r.get('efficiency_cudnn'), 2)} | "
            f"{f(r.get('fwd_bwd_cudnn_us'))} | {f(r.get('fwd_bwd_efficiency_cudnn'), 2)} |")


def pending_line(pending) -> str:
    """The line a partial result ends with: the run's shapes it holds no record of (it ended before them)."""
    if not pending:
        return ""
    shapes = "; ".join(",".join(map(str, s)) if isinstance(s, (tuple, list)) else str(s) for s in pending)
    return f"\nNot measured in this run (it ended before them): {shapes}.\n"


def result_base(out_dir: str, op: str, records, W) -> str:
    """``<out_dir>/<op>-<gpu>x<W>``, with ``-<N>hosts`` where the group spans N (virtual) hosts."""
    hosts = records[0].get("num_hosts", 1)
    return os.path.join(out_dir, f"{op}-{records[0]['gpu']}x{W}" + (f"-{hosts}hosts" if hosts > 1 else ""))


def write_table(op, records, W, out_dir: str, caption: str, header: str, row, label, pending=(),
                footer: str = "", extra: dict | None = None) -> None:
    """``<op>-<gpu>x<W>.json`` and ``.md``: the provenance, ``caption``, the table (``header``, ``row(record)`` per
    record), ``footer`` (summary lines) under it, each record's note under ``label(record)``, and the shapes still
    ``pending``; ``extra``: more fields of the JSON."""
    os.makedirs(out_dir, exist_ok=True)
    base = result_base(out_dir, op, records, W)
    save_json(base, op, W, records, pending, extra)
    with open(base + ".md", "w") as f:
        f.write(measured(base))
        f.write(f"{op}, {records[0]['gpu']} x{W}, {caption}\n\n{header}\n")
        f.write("\n".join(row(r) for r in records) + "\n")
        f.write(f"\n{footer}" if footer else "")
        f.write(pending_line(pending))
        notes = [f"- {label(r)}: {r['note']}" for r in records if r["note"]]
        if notes:
            f.write("\nnotes:\n" + "\n".join(notes) + "\n")


def write_cp(records, W, out_dir: str, pending=()) -> None:
    caption = ("median µs (max over ranks); efficiency = SDPA 1 GPU / (W x ours), flash or cuDNN backend"
               + ("; ours, NCCL + kernel, SDPA and our kernel alone timed in turns within each iteration (forward, "
                  "and forward + backward, each a group), so all see the same GPU clock (the values timed one "
                  "after another: *_seq_us in the JSON)" if "ours_seq_us" in records[0] else "")
               + across_hosts(records))
    write_table("cp_attention", records, W, out_dir, caption, CP_HEADER, _cp_row,
                 lambda r: f"S={r['S']} D={r['D']} Hkv={r['Hkv']} {r.get('dtype', 'bf16')} causal={r['causal']}",
                 pending)


AR_HEADER = ("| bytes | ours µs | one-shot forced µs | two-shot forced µs | NCCL µs | torch one-shot µs | "
             "torch two-shot µs | bound µs | speed-up vs NCCL | ours / bound | ours graph µs | one-shot graph µs | "
             "two-shot graph µs | NCCL graph µs | speed-up vs NCCL, graphs | NCCL symm µs | NCCL symm graph µs | "
             "ours b2b µs | one-shot forced b2b µs | NCCL b2b µs | NCCL symm b2b µs | torch one-shot b2b µs | "
             "torch two-shot b2b µs | b2b speed-up, ours vs best baseline |\n|" + "---|" * 24)
# ours: fallback="auto" ("(NCCL)" where it handed the message to the process group); bound: an empty kernel's
# latency plus the message over the measured bandwidth of a copy into a peer's memory; NCCL symm: dist.all_reduce on
# a buffer registered for NCCL's symmetric kernels (benchmarks/nccl_symm.py); b2b: consecutive calls in one CUDA
# graph, the replay's time per call (bench.time_back_to_back)

#: the baselines of the AllReduce's back-to-back columns: (record key, name in the table)
AR_B2B_BASELINES = (("nccl_b2b_us", "NCCL"), ("nccl_symm_b2b_us", "NCCL symm"),
                    ("torch_one_shot_b2b_us", "torch one-shot"), ("torch_two_shot_b2b_us", "torch two-shot"))


def _us(v) -> str:
    return "n/a" if v is None else f"{v:8.1f}"


def _speedup(a, b) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def _ours_path(r) -> str:
    return " (NCCL)" if r.get("path") == "fallback" else ""


def best_baseline(r, baselines=AR_B2B_BASELINES):
    """``(key, name, µs)`` of the fastest of ``baselines`` measured in record ``r``; None where none was."""
    got = [(r[k], k, name) for k, name in baselines if r.get(k)]
    if not got:
        return None
    us, key, name = min(got)
    return key, name, us


def b2b_speedup(r) -> str:
    """The back-to-back speed-up of ours (as a user gets it) over the fastest baseline, naming it: ``1.23x vs NCCL
    symm``; n/a where either is missing."""
    best = best_baseline(r)
    if best is None or not r.get("ours_b2b_us"):
        return "n/a"
    return f"{best[2] / r['ours_b2b_us']:.2f}x vs {best[1]}"


def ar_row(r):
    f, ratio, path = _us, _speedup, _ours_path(r)
    return (f"| {r['bytes']} | {f(r.get('ours_us'))}{path} | {f(r.get('one_shot_us'))} | {f(r.get('two_shot_us'))} | "
            f"{f(r.get('nccl_us'))} | {f(r.get('torch_one_shot_us'))} | {f(r.get('torch_two_shot_us'))} | "
            f"{f(r['bound_us'])} | {ratio(r.get('nccl_us'), r.get('ours_us'))} | "
            f"{ratio(r.get('ours_us'), r['bound_us'])} | {f(r.get('ours_graph_us'))} | "
            f"{f(r.get('one_shot_graph_us'))} | {f(r.get('two_shot_graph_us'))} | {f(r.get('nccl_graph_us'))} | "
            f"{ratio(r.get('nccl_graph_us'), r.get('ours_graph_us'))} | {f(r.get('nccl_symm_us'))} | "
            f"{f(r.get('nccl_symm_graph_us'))} | {f(r.get('ours_b2b_us'))}{path} | {f(r.get('one_shot_b2b_us'))} | "
            f"{f(r.get('nccl_b2b_us'))} | {f(r.get('nccl_symm_b2b_us'))} | {f(r.get('torch_one_shot_b2b_us'))} | "
            f"{f(r.get('torch_two_shot_b2b_us'))} | {b2b_speedup(r)} |")


def write_all_reduce(records, W, out_dir: str, pending=()) -> None:
    caption = (f"bf16, median µs (max over ranks), timed in turns within each iteration; peer copy bandwidth "
               f"{records[0]['peer_bandwidth_gbs']:.0f} GB/s, empty kernel {records[0]['latency_us']:.1f} µs")
    if records[0].get("b2b_calls"):
        caption += (f"; b2b: {records[0]['b2b_calls']} calls back to back in one CUDA graph, the replay's median "
                    "µs over the calls, the graphs timed in turns; NCCL symm: dist.all_reduce on a buffer registered "
                    "for NCCL's symmetric kernels (how, or why not, and the kernels NCCL ran: each record's note and "
                    "nccl_symm / nccl_kernels / nccl_symm_kernels in the JSON)")
    write_table("all_reduce", records, W, out_dir, caption, AR_HEADER, ar_row, lambda r: f"{r['bytes']} bytes",
                 pending)


AR_RMSNORM_HEADER = ("| M | H | ours µs | NCCL + add + RMSNorm µs | one-shot + add + RMSNorm µs | speed-up vs NCCL | "
                     "ours graph µs | NCCL + add + RMSNorm graph µs | one-shot + add + RMSNorm graph µs | "
                     "speed-up vs NCCL, graphs | speed-up vs one-shot, graphs | ours b2b µs | "
                     "NCCL + add + RMSNorm b2b µs | one-shot + add + RMSNorm b2b µs | speed-up vs NCCL, b2b | "
                     "speed-up vs one-shot, b2b | rel. err vs NCCL path |\n|" + "---|" * 17)
# ours: AllReduceRMSNorm, one kernel; NCCL + add + RMSNorm: dist.all_reduce in place, torch.add,
# torch.nn.functional.rms_norm; one-shot + add + RMSNorm: our AllReduce (one-shot forced), torch.add, rms_norm;
# speed-ups: the other's time over ours; rel. err: ours' normed output against the NCCL path's

#: AllReduce + RMSNorm's target: fused over the three separate calls, in CUDA graphs
AR_RMSNORM_TARGET = 1.5


def ar_rmsnorm_row(r):
    f, ratio = _us, _speedup
    err = r.get("rel_err")
    return (f"| {r['M']} | {r['H']} | {f(r.get('ours_us'))} | {f(r.get('nccl_us'))} | {f(r.get('one_shot_us'))} | "
            f"{ratio(r.get('nccl_us'), r.get('ours_us'))} | {f(r.get('ours_graph_us'))} | "
            f"{f(r.get('nccl_graph_us'))} | {f(r.get('one_shot_graph_us'))} | "
            f"{ratio(r.get('nccl_graph_us'), r.get('ours_graph_us'))} | "
            f"{ratio(r.get('one_shot_graph_us'), r.get('ours_graph_us'))} | {f(r.get('ours_b2b_us'))} | "
            f"{f(r.get('nccl_b2b_us'))} | {f(r.get('one_shot_b2b_us'))} | "
            f"{ratio(r.get('nccl_b2b_us'), r.get('ours_b2b_us'))} | "
            f"{ratio(r.get('one_shot_b2b_us'), r.get('ours_b2b_us'))} | {'n/a' if err is None else f'{err:.1e}'} |")


def speedup_summary(records, base: str, ours: str, what: str, target: float | None = None) -> str:
    """A line: the geometric mean and the lowest of ``record[base] / record[ours]`` over the records that have both
    (which record is lowest, by M and H), and how many reach ``target``; "" where none has both."""
    got = [(r[base] / r[ours], r) for r in records if r.get(base) and r.get(ours)]
    if not got:
        return ""
    geo = math.exp(sum(math.log(v) for v, _ in got) / len(got))
    low, r = min(got, key=lambda t: t[0])
    line = f"{what}: geometric mean {geo:.2f}x, lowest {low:.2f}x (M={r['M']}, H={r['H']})"
    if target is not None:
        line += f", {sum(v >= target for v, _ in got)} of {len(got)} shapes at or above the target {target:.1f}x"
    return line + "\n"


def write_all_reduce_rmsnorm(records, W, out_dir: str, pending=()) -> None:
    """``all_reduce_rmsnorm-<gpu>x<W>.{json,md}``: the table (AR_RMSNORM_HEADER), and under it the speed-ups over
    the three separate calls and over our one-shot + add + RMSNorm, in graphs and back to back."""
    calls = records[0].get("b2b_calls")
    caption = (f"{records[0].get('dtype', 'bfloat16')}, eps {records[0].get('eps')}, median µs (max over ranks); "
               "eager columns timed alone, then in turns within each iteration (the values timed alone: *_seq_us in "
               "the JSON); graph: one call per CUDA-graph replay"
               + (f"; b2b: {calls} calls back to back in one CUDA graph, the replay's median µs over the calls, the "
                  "graphs timed in turns" if calls else "")
               + "; NCCL + add + RMSNorm: dist.all_reduce in place, torch.add, torch.nn.functional.rms_norm; one-shot "
               "+ add + RMSNorm: our AllReduce (one-shot forced), torch.add, rms_norm; rel. err: ours' normed output "
               "against the NCCL path's (against float64: *_rel_err_fp64 in the JSON)")
    footer = "".join(speedup_summary(records, base, ours, what, target) for base, ours, what, target in (
        ("nccl_graph_us", "ours_graph_us", "speed-up over NCCL + add + RMSNorm, graphs", AR_RMSNORM_TARGET),
        ("nccl_b2b_us", "ours_b2b_us", "speed-up over NCCL + add + RMSNorm, back to back", AR_RMSNORM_TARGET),
        ("nccl_us", "ours_us", "speed-up over NCCL + add + RMSNorm, eager", None),
        ("one_shot_graph_us", "ours_graph_us", "speed-up over one-shot + add + RMSNorm, graphs", None),
        ("one_shot_b2b_us", "ours_b2b_us", "speed-up over one-shot + add + RMSNorm, back to back", None)))
    write_table("all_reduce_rmsnorm", records, W, out_dir, caption, AR_RMSNORM_HEADER, ar_rmsnorm_row,
                 lambda r: f"M={r['M']} H={r['H']}", pending, footer)


GEMM_AR_HEADER = ("| M | K | N | ours µs | fused kernel µs | matmul + our AllReduce µs | matmul + NCCL µs | "
                  "GEMM alone µs | speed-up vs NCCL | ours graph µs | fused kernel graph µs | "
                  "matmul + our AllReduce graph µs | matmul + NCCL graph µs | speed-up vs NCCL, graphs |\n|"
                  + "---|" * 14)
# ours: GEMMAllReduce as a user gets it (its path in brackets); fused kernel: algorithm="fused"; matmul + our
# AllReduce: fused_max_rows=0 (the AllReduce's own path); speed-ups: matmul + NCCL's time over ours


def gemm_ar_row(r):
    f, ratio = _us, _speedup
    path = f" ({r['algorithm']})" if r.get("algorithm") else _ours_path(r)
    unfused = f" ({r['unfused_algorithm']})" if r.get("unfused_algorithm") else ""
    return (f"| {r['M']} | {r['K']} | {r['N']} | {f(r.get('ours_us'))}{path} | {f(r.get('fused_us'))} | "
            f"{f(r.get('ours_unfused_us'))}{unfused} | {f(r.get('nccl_us'))} | {f(r.get('gemm_us'))} | "
            f"{ratio(r.get('nccl_us'), r.get('ours_us'))} | {f(r.get('ours_graph_us'))} | "
            f"{f(r.get('fused_graph_us'))} | {f(r.get('ours_unfused_graph_us'))} | {f(r.get('nccl_graph_us'))} | "
            f"{ratio(r.get('nccl_graph_us'), r.get('ours_graph_us'))} |")


def write_gemm_ar(records, W, out_dir: str, pending=()) -> None:
    caption = ("bf16, K over all ranks (each has K/W), B as weight.t(), median µs (max over ranks), timed in turns "
               "within each iteration")
    write_table("gemm_ar", records, W, out_dir, caption, GEMM_AR_HEADER, gemm_ar_row,
                 lambda r: f"{r['M']}x{r['K']}x{r['N']}", pending)


def _row(r):
    f = lambda v: "n/a" if v is None else f"{v:8.1f}"  # noqa: E731
    sp = (r["nccl_us"] / r["ours_us"]) if r["ours_us"] else float("nan")
    vs_bound = r["ours_us"] / r["bound_us"]
    fused = (r["torch_fused_us"] / r["ours_us"]) if r.get("torch_fused_us") else None
    gsp = (r["nccl_graph_us"] / r["ours_graph_us"]) if r.get("ours_graph_us") and r.get("nccl_graph_us") else None
    path = " (NCCL)" if r.get("path") == "fallback" else ""
    path0 = " (NCCL)" if r.get("no_replay_path") == "fallback" else ""
    return (f"| {r['M']} | {r['K']} | {r['N']} | {f(r['ours_us'])}{path} | {f(r.get('ours_no_replay_us'))}{path0} | "
            f"{f(r.get('ours_overlap_us'))} | "
            f"{f(r.get('host_enqueue_us'))} | {f(r.get('host_replay_us'))} | {f(r['nccl_us'])} | "
            f"{f(r.get('torch_fused_us'))} | {f(r['bound_us'])} | {f(r['consumer_only_us'])} | {sp:.2f}x | "
            f"{'n/a' if fused is None else f'{fused:.2f}x'} | "
            f"{vs_bound:.2f} | {r['bound_us'] / r['consumer_only_us']:.2f} | {f(r.get('ours_graph_us'))} | "
            f"{f(r.get('nccl_graph_us'))} | {'n/a' if gsp is None else f'{gsp:.2f}x'} | "
            f"{f(_variant(r, ''))} | {f(_variant(r, '_graph'))} |")


def _variant(r, kind: str):
    """The variant column's time (``kind``: "" eager, "_graph" replayed): the first of the records' variants."""
    return next((r[k] for k in (f"ours_{v}{kind}_us" for v in ("pull", "copy", "store", "direct")) if k in r), None)


HEADER = ("| M | K | N | ours µs | ours, no replay µs | overlap forced, no replay µs | host enqueue µs | "
          "host, replayed µs | NCCL+cuBLAS µs | torch fused µs | "
          "bound µs | consumer alone µs | speed-up vs NCCL | speed-up vs fused | ours / bound | consumer vs cuBLAS | "
          "ours graph µs | NCCL+cuBLAS graph µs | graph speed-up | variant µs | variant graph µs |\n|" + "---|" * 21)
# ours: fallback="auto" and replay on, what a user gets (an eager call that repeats its tensors replays the op's
# own CUDA graph, ops.replay); "(NCCL)" where the eager rule (ops.common.eager_host_bound) took NCCL + cuBLAS;
# no replay: the same with replay=False; overlap forced: fallback="never", replay=False; host enqueue: host µs of
# one forced call, GPU idle; host, replayed: the same for ours
# variant: AllGather-GEMM pull mode (ours_pull_*); GEMM-ReduceScatter: the scatter mode "auto" did not pick
# (ours_copy_* where ours stored, ours_store_* where ours copied; the record's "scatter" names ours), or across hosts
# of several GPUs each, where ours sums a host's partials before they cross, each partial crossing directly
# (ours_direct_*)


WT_HEADER = ("| M | K | N | ours µs | NCCL+cuBLAS µs | speed-up vs NCCL | bound µs | ours / bound | "
             "consumer alone µs | consumer vs cuBLAS |\n|" + "---|" * 10)


def _wt_row(r):
    return (f"| {r['M']} | {r['K']} | {r['N']} | {r['ours_wt_us']:.1f} | {r['nccl_wt_us']:.1f} | "
            f"{r['nccl_wt_us'] / r['ours_wt_us']:.2f}x | {r['bound_wt_us']:.1f} | "
            f"{r['ours_wt_us'] / r['bound_wt_us']:.2f} | "
            f"{r['consumer_only_wt_us']:.1f} | {r['bound_wt_us'] / r['consumer_only_wt_us']:.2f} |")


def across_hosts(records) -> str:
    """The caption's words on the hosts a run's group spans (nothing on one host)."""
    hosts = records[0].get("num_hosts", 1)
    if hosts == 1:
        return ""
    return (f"; the group spans {hosts} (virtual) hosts, data between them through NCCL; ours enqueues every eager "
            "call anew (no replay across hosts: docs/hosts.md)")


def write(op_name, records, W, out_dir: str, pending=()) -> float:
    """The JSON, table and plot of a GEMM op's records (``pending``: the run's shapes not measured yet); returns the
    geometric-mean speed-up over NCCL + cuBLAS."""
    os.makedirs(out_dir, exist_ok=True)
    base = result_base(out_dir, op_name, records, W)
    save_json(base, op_name, W, records, pending)
    sp = [r["nccl_us"] / r["ours_us"] for r in records]
    geo = math.exp(sum(math.log(s) for s in sp) / len(sp))
    with open(base + ".md", "w") as f:
        f.write(measured(base))
        dtype = records[0].get("dtype", "bf16")
        lead = records[0].get("lead_us", 0)
        f.write(f"{op_name}, {records[0]['gpu']} x{W}, {dtype}, median µs (max over ranks); bound and consumer alone "
                f"timed as CUDA-graph replays (GPU time; eager timings in the JSON as *_eager_us); "
                + (f"before each timed call the ranks are lined up on the device and the host is ahead "
                   f"(a {lead:.0f} µs "
                   "spin before and after the aligning all_reduce), except the two no-replay columns, timed with "
                   "the GPU idle until the host has enqueued (*_idle_us in the JSON: ours and NCCL timed so too)"
                   if lead else "the GPU idles before each call until the host has enqueued it")
                + ("; ours, NCCL + cuBLAS, torch fused, bound and consumer alone timed in turns within each "
                   "iteration, so all see the same GPU clock (the values timed one after another: *_seq_us in the "
                   "JSON)" if "ours_seq_us" in records[0] else "") + across_hosts(records) + f"\n\n{HEADER}\n")
        f.write("\n".join(_row(r) for r in records))
        replay = "replay on" if records[0].get("num_hosts", 1) == 1 else "no replay across hosts"
        f.write(f"\n\ngeometric-mean speed-up over NCCL + cuBLAS (eager, fallback=\"auto\", {replay}): {geo:.3f}x\n")
        idle = [r["nccl_idle_us"] / r["ours_idle_us"] for r in records
                if r.get("ours_idle_us") and r.get("nccl_idle_us")]
        if idle:
            f.write(f"geometric-mean speed-up over NCCL + cuBLAS (eager, both with the GPU idle before each call): "
                    f"{math.exp(sum(map(math.log, idle)) / len(idle)):.3f}x\n")
        plain = [r["nccl_us"] / r["ours_no_replay_us"] for r in records if r.get("ours_no_replay_us")]
        if plain:
            f.write(f"geometric-mean speed-up over NCCL + cuBLAS (eager, fallback=\"auto\", no replay): "
                    f"{math.exp(sum(map(math.log, plain)) / len(plain)):.3f}x\n")
        forced = [r["nccl_us"] / r["ours_overlap_us"] for r in records if r.get("ours_overlap_us")]
        if forced:
            f.write(f"geometric-mean speed-up over NCCL + cuBLAS (eager, overlap forced): "
                    f"{math.exp(sum(map(math.log, forced)) / len(forced)):.3f}x\n")
        gs = [r["nccl_graph_us"] / r["ours_graph_us"] for r in records
              if r.get("ours_graph_us") and r.get("nccl_graph_us")]
        if gs:
            f.write(f"geometric-mean speed-up over NCCL + cuBLAS (both in CUDA graphs): "
                    f"{math.exp(sum(map(math.log, gs)) / len(gs)):.3f}x\n")
        wt = [r for r in records if r.get("ours_wt_us")]
        if wt:
            f.write("\nB stored as [N, K] and passed transposed (nn.Linear's weight.t()), eager, as a user gets it\n\n"
                    f"{WT_HEADER}\n" + "\n".join(_wt_row(r) for r in wt))
            g = math.exp(sum(math.log(r["nccl_wt_us"] / r["ours_wt_us"]) for r in wt) / len(wt))
            f.write(f"\n\ngeometric-mean speed-up over NCCL + cuBLAS, B as weight.t(): {g:.3f}x\n")
        f.write(pending_line(pending))
        notes = [f"- {r['M']},{r['K']},{r['N']}: {r['note']}" for r in records if r["note"]]
        if notes:
            f.write("\nnotes:\n" + "\n".join(notes) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r['M']}x{r['K']}x{r['N']}" for r in records]
        x = range(len(records))
        fig, ax = plt.subplots(figsize=(10, 4))
        for i, (key, name) in enumerate([("ours_us", "ours"), ("nccl_us", "NCCL+cuBLAS"),
                                         ("torch_fused_us", "torch fused"), ("bound_us", "bound (GEMM alone)")]):
            ax.bar([xi + 0.2 * i for xi in x], [r.get(key) or 0 for r in records], width=0.2, label=name)
        ax.set_xticks([xi + 0.3 for xi in x], labels, rotation=20)
        ax.set_ylabel("µs (lower is better)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=100)
    except ImportError:
        pass
    return geo
