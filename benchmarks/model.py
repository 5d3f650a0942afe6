"""Model-level benchmarks: the step a user runs, on benchmarks/llama.py's decoder stack at Llama-3 layer shapes.

Training step (forward + backward, bf16 parameters, tensor + sequence parallel over W ranks), tokens/s of:

* ``ours``: this project's styles (tp_plan_ours, ``fallback="auto"``, as a user gets them: wq/wk/wv and w1/w3 as
  SharedInputColwise groups, each group's input gathered once, as torch's plan gathers it), eager;
* ``ours_unshared``: the same with a ColwiseParallel per projection, each gathering its input itself (three
  gathers for wq/wk/wv, two for w1/w3);
* ``ours_fused`` and ``torch_tp_fused``: ours and torch TP on the same weights with fused projections
  (llama.fuse_projections: one wqkv, one w13; no weights concatenated per step);
* ``ours_compiled`` and ``ours_compiled_fused``: ours and ours_fused, each block under ``torch.compile``;
* ``ours_fallback``: the same layers with ``fallback="always"`` (torch + the process group, no overlap kernels);
* ``torch_tp``: torch's own styles (tp_plan_torch), NCCL, eager;
* ``torch_async_tp``: torch's styles, each block under ``torch.compile`` with inductor's micro-pipeline TP
  (``_micro_pipeline_tp``) and symmetric memory enabled for the group: torchtitan's async TP.

Decode step (one token per sequence against a KV cache, replicated activations, captured in a CUDA graph),
µs per step of: ``ours`` (row-wise layers through GEMM + AllReduce), ``ours_norm`` (the same layers, each
row-wise layer's AllReduce, the residual add and the next RMSNorm in one kernel: llama.decode_fused_norm with
triton_overlap's AllReduceRMSNorm), ``ours_fallback``, ``torch_tp`` (torch's styles: matmul + NCCL all-reduce)
and ``torch_symm_mem`` (matmul into symmetric memory + torch's one-shot all-reduce); ``ours_norm_fused`` and
``torch_tp_fused``: ours_norm and torch TP with fused projections (one wqkv, one w13), as serving engines run
decode: three column GEMMs a block instead of five.

Timing as benchmarks/bench.py times ops: every variant is built and warmed up first (a variant that fails is
recorded in the note and left out), then all are timed in turns within each iteration
(triton_overlap.timing.time_interleaved: ranks lined up on the device before each call with a lead of
``lead_us``, CUDA events around the call, median over iterations, max over ranks). Each variant's output on the
same tokens is compared with torch TP's (``<variant>_rel_err``): the columns do the same work. After the timed
steps, each eager training variant's host time to enqueue a step (``<variant>_host_us``: step_host_us) and, for
ours, the replays, rebound replays and captures per step of its overlapped calls (``<variant>_calls_per_step``).
GPUs with NCCL only.

A case is ``("train", shape, n_layers, batch, seq)`` or ``("decode", shape, n_layers, batch, cache_len)``,
``shape`` a key of llama.SHAPES; on the command line ``train,70b,2,1,8192``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import llama
import triton_overlap as to
from model_report import DECODE_COLUMNS, DECODE_HEADER, HOST_STEPS, TRAIN_COLUMNS, TRAIN_HEADER, decode_row, \
    train_row
from triton_overlap.nn import overlap_ops
from triton_overlap.timing import capture, host_us, time_interleaved
from triton_overlap.torchrun import say

#: layers per shape: a stack deep enough that a step is several layers' work, small enough that the nine
#: training variants' models (all kept, to be timed in turns) and one step's activations fit on one H200 at W = 2
DEFAULT_LAYERS = {"8b": 4, "70b": 2}
#: one sequence length per shape for training, three batch sizes for decode: what one run of ten minutes holds
#: (the compiled variants compile anew in every training case); other cases by name (parse_cases)
DEFAULT_CASES = ([("train", s, DEFAULT_LAYERS[s], 1, 8192) for s in ("8b", "70b")]
                 + [("decode", s, DEFAULT_LAYERS[s], b, 4096) for s in ("8b", "70b") for b in (1, 16, 64)])
TRAIN_VARIANTS = tuple(k for k, _ in TRAIN_COLUMNS)
DECODE_VARIANTS = tuple(k for k, _ in DECODE_COLUMNS)
#: seconds of timed steps per training variant at most (time_interleaved's budget_s)
TRAIN_BUDGET_S = 5.0
#: decode steps take a millisecond or less: more iterations than a training step's
DECODE_MIN_ITERS = 50
#: the eager training variants: their host time per step is measured, and ours' replays counted
EAGER_TRAIN = ("ours", "ours_unshared", "ours_fused", "ours_fallback", "torch_tp", "torch_tp_fused")


def parse_cases(specs) -> list[tuple]:
    """``["train,70b,2,1,8192", "decode,8b,4,16,4096"]`` -> cases (see the module's docstring)."""
    cases = []
    for spec in specs:
        kind, shape, *nums = spec.split(",")
        if kind not in ("train", "decode") or shape not in llama.SHAPES or len(nums) != 3:
            raise SystemExit(f"model: a case is train|decode,SHAPE,LAYERS,BATCH,SEQ|CACHE with SHAPE one of "
                             f"{sorted(llama.SHAPES)}, not {spec!r}")
        cases.append((kind, shape, *map(int, nums)))
    return cases


def gpu_name() -> str:
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "_")


def _note(rec, name, e) -> None:
    rec["note"] += f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}; "


def enable_symm_mem(group_name: str):
    """Turn on torch's symmetric memory for the group (async TP and the one-shot all-reduce need it): None, or
    why not."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group_name)
        return None
    except Exception as e:  # noqa: BLE001 - recorded as the variants' note
        return f"symm_mem unavailable: {type(e).__name__}: {e}"


def compile_blocks(model, **options):
    """Each decoder block under ``torch.compile`` (as torchtitan compiles: per block, in place, so the module
    names stay), with inductor ``options``."""
    for layer in model.layers:
        layer.compile(options=options or None)
    return model


def ours_paths(model) -> list:
    """The paths ("overlap", "fallback") the model's overlapped layers took on their last call, where they
    say (``last_path``)."""
    return sorted({str(m.last_path) for m in model.modules() if getattr(m, "last_path", None) is not None})


def step_host_us(step, model) -> tuple[float, dict]:
    """The host's time to enqueue one step (timing.host_us: each started on an idle device, median over
    HOST_STEPS, max over ranks; near the step's time, the step is host-bound), and what the model's overlapped calls
    did per step meanwhile, on this rank (nn.overlap_ops' replay counts): ``replays`` of captured graphs (of them
    ``rebound`` to new addresses) and ``captures``."""
    ops = overlap_ops(model)
    before = [dict(op.replays.stats) for op in ops]
    us = host_us(step, HOST_STEPS)
    calls = {k: sum(op.replays.stats[k] - b[k] for op, b in zip(ops, before)) / HOST_STEPS
             for k in ("replays", "rebound", "captures")}
    return us, calls


def _record(ctx, kind, shape, n_layers, batch, seq, lead_us) -> dict:
    s = llama.SHAPES[shape]
    return {"kind": kind, "model": s.name, "dim": s.dim, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads,
            "head_dim": s.head_dim, "ffn_dim": s.ffn_dim, "vocab": s.vocab, "n_layers": n_layers, "batch": batch,
            "seq": seq, "world_size": ctx.world_size, "gpu": gpu_name(), "dtype": "bfloat16", "lm_head": False,
            "lead_us": lead_us, "note": ""}


def _rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def bench_train(ctx, shape, n_layers, batch, seq, iters, lead_us) -> dict:
    """One training case: every variant of TRAIN_VARIANTS built, checked against torch TP's output and timed."""
    W, dev = ctx.world_size, ctx.device
    rec = _record(ctx, "train", shape, n_layers, batch, seq, lead_us)
    mesh, group = llama.mesh_of(ctx), dist.group.WORLD.group_name
    symm_note = enable_symm_mem(group)
    g = torch.Generator(device=dev).manual_seed(1)  # the same tokens and output gradient on every rank
    tokens = torch.randint(0, llama.SHAPES[shape].vocab, (batch, seq), device=dev, generator=g)
    gy = torch.randn(batch, seq, llama.SHAPES[shape].dim, device=dev, dtype=torch.bfloat16, generator=g)

    def model(plan, fused=False):
        built = llama.build(shape, n_layers, torch.bfloat16, dev, max_seq=seq, fuse_for=W if fused else 0)
        return llama.parallelize(built, mesh, plan)

    def async_tp():
        if symm_note:
            raise RuntimeError(symm_note)
        return compile_blocks(model(llama.tp_plan_torch()), _micro_pipeline_tp=True)

    makers = {"torch_tp": lambda: model(llama.tp_plan_torch()),  # first: the reference the others are checked on
              "ours": lambda: model(llama.tp_plan_ours(ctx)),
              "ours_unshared": lambda: model(llama.tp_plan_ours(ctx, shared=False)),
              "ours_fused": lambda: model(llama.tp_plan_ours(ctx, fused=True), fused=True),
              "torch_tp_fused": lambda: model(llama.tp_plan_torch(), fused=True),
              "ours_compiled": lambda: compile_blocks(model(llama.tp_plan_ours(ctx))),
              "ours_compiled_fused": lambda: compile_blocks(model(llama.tp_plan_ours(ctx, fused=True), fused=True)),
              "ours_fallback": lambda: model(llama.tp_plan_ours(ctx, fallback="always")),
              "torch_async_tp": async_tp}
    steps, models, ref = {}, {}, None
    for name, make in makers.items():
        rec[f"{name}_us"] = None
        try:
            m = make()

            def step(m=m):
                m.zero_grad(set_to_none=True)
                out = m(tokens)
                out.backward(gy)
                return out.detach()

            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = step()
            for _ in range(2):  # compiles, tunes and allocates before anything is timed
                step()
            torch.cuda.synchronize()
            ctx.check()
            # what a step adds to the memory its model holds (activations, gradients, workspaces)
            rec[f"{name}_step_peak_gib"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
            if ref is None:
                ref, rec["rel_err_reference"] = out, name
            rec[f"{name}_rel_err"] = _rel_err(out, ref)
            if name.startswith("ours"):
                rec[f"{name}_paths"] = ours_paths(m)
            steps[name] = step
            models[name] = m
        except Exception as e:  # noqa: BLE001 - recorded in the note; the other variants go on
            _note(rec, name, e)
    if steps:
        rec.update({f"{k}_us": v for k, v in time_interleaved(steps, iters, budget_s=TRAIN_BUDGET_S,
                                                              lead_us=lead_us).items()})
        for name in EAGER_TRAIN:
            if name in steps:
                try:
                    rec[f"{name}_host_us"], calls = step_host_us(steps[name], models[name])
                except Exception as e:  # noqa: BLE001 - recorded in the note; the other variants go on
                    _note(rec, f"{name} host time", e)
                    continue
                if name.startswith("ours"):
                    rec[f"{name}_calls_per_step"] = calls
        ctx.check()
    steps.clear()
    models.clear()
    torch._dynamo.reset()  # the compiled blocks hold the case's models
    tokens_per_step = batch * seq
    flops = llama.flops_per_token(llama.SHAPES[shape], n_layers, seq) * tokens_per_step
    for name in TRAIN_VARIANTS:
        us = rec.get(f"{name}_us")
        rec[f"{name}_tokens_per_s"] = None if not us else tokens_per_step / us * 1e6
        rec[f"{name}_tflops_per_gpu"] = None if not us else flops / W / us / 1e6
    return rec


def bench_decode(ctx, shape, n_layers, batch, cache_len, iters, lead_us) -> dict:
    """One decode case: every variant of DECODE_VARIANTS built, its step (one token per sequence at the cache's
    last position) checked against torch TP's output, captured in a CUDA graph and its replay timed."""
    dev = ctx.device
    rec = _record(ctx, "decode", shape, n_layers, batch, cache_len, lead_us)
    rec["cache_len"] = cache_len
    mesh, group = llama.mesh_of(ctx), dist.group.WORLD.group_name
    symm_note = enable_symm_mem(group)
    g = torch.Generator(device=dev).manual_seed(2)
    tokens = torch.randint(0, llama.SHAPES[shape].vocab, (batch, 1), device=dev, generator=g)
    input_pos = torch.tensor([cache_len - 1], device=dev)  # attends to the whole cache

    def symm_mem_plan():
        if symm_note:
            raise RuntimeError(symm_note)
        return llama.decode_plan_symm_mem(group)

    plans = {"torch_tp": llama.decode_plan_torch, "ours": lambda: llama.decode_plan_ours(ctx),
             "ours_norm": lambda: llama.decode_plan_ours(ctx),
             "ours_fallback": lambda: llama.decode_plan_ours(ctx, fallback="always"), "torch_symm_mem": symm_mem_plan,
             "ours_norm_fused": lambda: llama.decode_plan_ours(ctx), "torch_tp_fused": llama.decode_plan_torch}
    norm_op = to.AllReduceRMSNorm(ctx, name="bench.model.ar_rmsnorm")
    replays, ref = {}, None
    for name, plan in plans.items():
        rec[f"{name}_us"] = None
        try:
            fuse_for = ctx.world_size if name.endswith("_fused") else 0
            m = llama.parallelize(llama.build(shape, n_layers, torch.bfloat16, dev, max_seq=cache_len,
                                              fuse_for=fuse_for), mesh, plan())
            m.setup_cache(batch, cache_len)

            def step(m=m, fused=name.startswith("ours_norm")):
                with torch.no_grad():
                    return llama.decode_fused_norm(m, tokens, input_pos, norm_op) if fused else m(tokens, input_pos)

            out = step()
            ctx.check()
            if ref is None:
                ref, rec["rel_err_reference"] = out, name
            rec[f"{name}_rel_err"] = _rel_err(out, ref)
            if name.startswith("ours"):
                rec[f"{name}_paths"] = ours_paths(m) + ([f"norm {norm_op.last_path}"] if name.startswith("ours_norm")
                                                        else [])
            replays[name] = capture(step).replay
            ctx.check()
        except Exception as e:  # noqa: BLE001 - recorded in the note; the other variants go on
            _note(rec, name, e)
    if replays:
        rec.update({f"{k}_us": v for k, v in time_interleaved(replays, max(iters, DECODE_MIN_ITERS), budget_s=2.0,
                                                              lead_us=lead_us).items()})
        ctx.check()
    return rec


def bench_model(ctx, cases=None, iters: int = 10, write_partial=None, lead_us: float = 500.0) -> list[dict]:
    """Every case of ``cases`` (default DEFAULT_CASES; strings are parsed with parse_cases), one record each;
    ``write_partial(records)`` after each, so a run cut short keeps what it measured."""
    if not torch.cuda.is_available():
        raise SystemExit("model: needs GPUs")
    if dist.get_backend() != "nccl":  # (--shared-gpu: gloo)
        raise SystemExit(f"model: needs an NCCL process group, not {dist.get_backend()}: torch TP's DTensor "
                         "all-gather over gloo on CUDA tensors crashes the process (SIGSEGV)")
    cases = DEFAULT_CASES if cases is None else [c if isinstance(c, tuple) else parse_cases([c])[0] for c in cases]
    records, last_kind = [], None
    for kind, shape, n_layers, batch, seq in cases:
        if kind != last_kind:
            say(TRAIN_HEADER if kind == "train" else DECODE_HEADER)
            last_kind = kind
        bench = bench_train if kind == "train" else bench_decode
        rec = bench(ctx, shape, n_layers, batch, seq, iters, lead_us)
        records.append(rec)
        torch.cuda.empty_cache()  # the case's models are gone; the next one starts from free memory
        if write_partial is not None:
            write_partial(records)
        say(train_row(rec) if kind == "train" else decode_row(rec))
    return records
