"""The model benchmark's report: ``model-<gpu>x<W>.{json,md,png}`` with the provenance of report.py (commit,
date, torch, triton, GPU), each record's model shape, and the ratios users read: a training step's tokens/s of
ours over each baseline's, a decode step's latency of each baseline over ours (both > 1 where ours is faster)."""
from __future__ import annotations

import os

from report import geomean, measured, pending_line, result_base, save_json

#: training steps per eager variant whose host time is measured, after the timed ones (model.step_host_us)
HOST_STEPS = 5
#: (variant, its column's name), in the tables' order
TRAIN_COLUMNS = (("ours", "ours"), ("ours_unshared", "ours, a gather per projection"),
                 ("ours_fused", "ours, fused projections"), ("ours_compiled", "ours compiled"),
                 ("ours_compiled_fused", "ours compiled, fused projections"),
                 ("ours_fallback", "ours, fallback=always"), ("torch_tp", "torch TP"),
                 ("torch_tp_fused", "torch TP, fused projections"), ("torch_async_tp", "torch async TP"))
DECODE_COLUMNS = (("ours", "ours"), ("ours_norm", "ours, AllReduce + RMSNorm fused"),
                  ("ours_fallback", "ours, fallback=always"), ("torch_tp", "torch TP (NCCL)"),
                  ("torch_symm_mem", "torch symm-mem one-shot"),
                  ("ours_norm_fused", "ours, AllReduce + RMSNorm fused, fused projections"),
                  ("torch_tp_fused", "torch TP (NCCL), fused projections"))
#: the ratios each table reports: (ours, baseline), the speed-up being baseline time / ours time; the first ones
#: also as geometric means under the table
TRAIN_RATIOS = (("ours", "torch_tp"), ("ours", "torch_async_tp"), ("ours_fused", "torch_tp_fused"),
                ("ours_fused", "torch_async_tp"), ("ours_compiled", "torch_async_tp"),
                ("ours_compiled_fused", "torch_async_tp"), ("ours", "ours_fallback"), ("ours", "ours_unshared"))
DECODE_RATIOS = (("ours", "torch_tp"), ("ours", "torch_symm_mem"), ("ours_norm", "torch_tp"),
                 ("ours_norm", "torch_symm_mem"), ("ours_norm_fused", "torch_tp_fused"), ("ours", "ours_fallback"))
_NAMES = dict(TRAIN_COLUMNS + DECODE_COLUMNS)


def _header(lead, columns, unit, ratios, tail=()) -> str:
    names = ([*lead] + [f"{name} {unit}" for _, name in columns]
             + [f"{_NAMES[a]} / {_NAMES[b]}" for a, b in ratios] + list(tail))
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


TRAIN_HEADER = _header(("model", "layers", "batch x seq"), TRAIN_COLUMNS, "ms", TRAIN_RATIOS,
                       ("ours tokens/s", "ours TFLOP/s per GPU", "ours host ms", "torch TP host ms",
                        "ours replays (rebound) per step"))
DECODE_HEADER = _header(("model", "layers", "batch", "KV cache"), DECODE_COLUMNS, "µs", DECODE_RATIOS)


def speedup(r, ours, base):
    """How many times faster ``ours`` ran than ``base`` in record ``r`` (tokens/s ratio; latency ratio): None
    where either was not measured."""
    a, b = r.get(f"{ours}_us"), r.get(f"{base}_us")
    return None if not a or not b else b / a


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _f(v, scale=1.0, d=1) -> str:
    return "n/a" if v is None else f"{v * scale:.{d}f}"


def train_row(r) -> str:
    return (f"| {r['model']} | {r['n_layers']} | {r['batch']} x {r['seq']} | "
            + " | ".join(_f(r.get(f"{k}_us"), 1e-3, 2) for k, _ in TRAIN_COLUMNS) + " | "
            + " | ".join(_x(speedup(r, a, b)) for a, b in TRAIN_RATIOS)
            + f" | {_f(r.get('ours_tokens_per_s'), 1, 0)} | {_f(r.get('ours_tflops_per_gpu'), 1, 0)} | "
            + f"{_f(r.get('ours_host_us'), 1e-3, 2)} | {_f(r.get('torch_tp_host_us'), 1e-3, 2)} | {_calls(r)} |")


def _calls(r) -> str:
    """Ours' replays per step, and of them those rebound to new addresses (model.step_host_us's counts)."""
    c = r.get("ours_calls_per_step")
    return "n/a" if not c else f"{c['replays']:.0f} ({c['rebound']:.0f})"


def decode_row(r) -> str:
    return (f"| {r['model']} | {r['n_layers']} | {r['batch']} | {r['cache_len']} | "
            + " | ".join(_f(r.get(f"{k}_us")) for k, _ in DECODE_COLUMNS) + " | "
            + " | ".join(_x(speedup(r, a, b)) for a, b in DECODE_RATIOS) + " |")


def _shapes(records) -> str:
    seen = {}
    for r in records:
        seen[r["model"]] = (f"{r['model']}: dim {r['dim']}, {r['n_heads']} heads, {r['n_kv_heads']} KV heads, "
                            f"head dim {r['head_dim']}, MLP {r['ffn_dim']}, vocabulary {r['vocab']}")
    return "; ".join(seen.values())


def write_model(records, W, out_dir: str, pending=()) -> None:
    """``model-<gpu>x<W>.json`` (every record, with the provenance), ``.md`` (the training and decode tables,
    geometric-mean ratios, notes) and ``.png`` (the ratios, where matplotlib is installed)."""
    os.makedirs(out_dir, exist_ok=True)
    base = result_base(out_dir, "model", records, W)
    save_json(base, "model", W, records, pending)
    train = [r for r in records if r["kind"] == "train"]
    decode = [r for r in records if r["kind"] == "decode"]
    with open(base + ".md", "w") as f:
        f.write(measured(base))
        f.write(f"model, {records[0]['gpu']} x{W}: a stack of Llama-3 decoder layers ({_shapes(records)}), bf16 "
                "parameters and activations, embedding included, no output head. Each variant's output on the same "
                "tokens matches torch TP's (`*_rel_err` in the JSON). All variants of a row are timed in turns "
                "within each iteration (ranks lined up before each call, CUDA events, median over iterations, max "
                "over ranks). Ratios: how many times faster ours ran (tokens/s for training, latency for decode).\n")
        if train:
            f.write("\nTraining step (forward + backward, tensor + sequence parallel over W; ours: this project's "
                    "styles, fallback=\"auto\", eager, wq/wk/wv and w1/w3 each a SharedInputColwise group, which "
                    "gathers its input once per attention and once per MLP, as torch's plan does; a gather per "
                    "projection: a ColwiseParallel each; torch TP: torch's styles, NCCL, eager; torch async TP: "
                    "torch's styles, each block compiled with inductor's micro-pipeline TP and symmetric memory; "
                    "fused projections: wq/wk/wv stored as one wqkv and w1/w3 as one w13), ms per step; host ms: the "
                    "host's time to enqueue one step started on an idle GPU (median of "
                    f"{HOST_STEPS}, max over ranks: near the step's time, the step is host-bound); replays per "
                    "step: ours' overlapped calls that replayed "
                    "a captured graph, and of them those rebound to new addresses (rank 0)\n\n"
                    f"{TRAIN_HEADER}\n" + "\n".join(train_row(r) for r in train) + "\n")
            for a, b in TRAIN_RATIOS[:5]:
                g = geomean(speedup(r, a, b) for r in train)
                if g:
                    f.write(f"\ngeometric-mean {_NAMES[a]} / {_NAMES[b]}: {g:.3f}x")
            f.write("\n")
        if decode:
            f.write("\nDecode step (one token per sequence at the KV cache's last position, replicated activations, "
                    "the whole step captured in a CUDA graph and replayed; ours: row-wise layers through GEMM + "
                    "AllReduce; ours, AllReduce + RMSNorm fused: the same layers, each row-wise layer's AllReduce, the "
                    "residual add and the next RMSNorm in one kernel (llama.decode_fused_norm); torch TP: torch's "
                    "styles, matmul + NCCL all-reduce; torch symm-mem: matmul into symmetric memory + "
                    "torch.ops.symm_mem.one_shot_all_reduce; fused projections: one wqkv and one w13 a block, as "
                    "serving engines run decode; every norm elsewhere is the model's own, in torch elementwise ops), "
                    "µs per step\n\n"
                    f"{DECODE_HEADER}\n" + "\n".join(decode_row(r) for r in decode) + "\n")
            for a, b in DECODE_RATIOS[:5]:
                g = geomean(speedup(r, a, b) for r in decode)
                if g:
                    f.write(f"\ngeometric-mean {_NAMES[a]} / {_NAMES[b]}: {g:.3f}x")
            f.write("\n")
        f.write(pending_line(pending))
        notes = [f"- {r['kind']} {r['model']} x{r['n_layers']} batch {r['batch']} seq {r['seq']}: {r['note']}"
                 for r in records if r["note"]]
        if notes:
            f.write("\nnotes:\n" + "\n".join(notes) + "\n")
    _plot(base, train, decode)


def _plot(base, train, decode) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(rows, ratios, title) for rows, ratios, title in
              ((train, TRAIN_RATIOS[:4], "training step, tokens/s ratio"),
               (decode, DECODE_RATIOS[:2], "decode step, latency ratio")) if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (rows, ratios, title) in zip(axes[0], panels):
        labels = [f"{r['model']} {r['batch']}x{r['seq']}" for r in rows]
        for i, (a, b) in enumerate(ratios):
            ax.bar([x + 0.8 / len(ratios) * i for x in range(len(rows))], [speedup(r, a, b) or 0 for r in rows],
                   width=0.8 / len(ratios), label=f"{_NAMES[a]} / {_NAMES[b]}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + 0.4 - 0.4 / len(ratios) for x in range(len(rows))], labels, rotation=20)
        ax.set_ylabel("times faster than the baseline")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=100)
    plt.close(fig)
