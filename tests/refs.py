"""Inputs every rank can rebuild for every other rank, and the plain-torch references (attention's among them)."""
import contextlib
import math
import os
import zlib

import torch

#: ||out - ref|| / ||ref|| allowed against a float32 reference (one rounding of the output
#: to 8 (bf16) or 11 (fp16) mantissa bits dominates; float32 accumulation adds far less)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rand(shape, dtype, device, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))  # same on every rank
    return torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def exact_inputs(shape, dtype, device, whole: bool, *seed):
    """``rand``'s values, or (``whole``) small whole numbers, whose sums over a few ranks every dtype holds exactly:
    then the sum is the same bits however a backend rounds (Triton's interpreter rounds float32 to 16 bits toward
    zero, GPUs to nearest)."""
    x = rand(shape, torch.float32, device, *seed)
    return (x * 4).round().to(dtype) if whole else x.to(dtype)


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "output has NaN: an element was not written or read poison"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


#: gradients against float32 autograd: rounded to the input dtype once
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


def attention(q, k, v, causal, scale):
    """Plain attention on the full sequence, float32; returns (out, lse) with lse [B, Hq, S]. Query heads go a few
    at a time, so that the [S, S] scores stay under about 2 GiB (several ranks may share one GPU)."""
    B, S, Hq, D = q.shape
    g = Hq // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    step = max(1, min(Hq, 2 ** 31 // (4 * B * S * S)))
    outs, lses = [], []
    for h in range(0, Hq, step):
        s = qf[:, h:h + step] @ kf[:, h:h + step].transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.softmax(s, dim=-1) @ vf[:, h:h + step])
    return torch.cat(outs, dim=1).transpose(1, 2), torch.cat(lses, dim=1)


def attention_docs(q, k, v, cu, causal, scale):
    """``attention`` per document of the packed [1, T, ...] sequence (a query sees its own document only)."""
    outs, lses = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            o, lse = attention(q[:, a:b], k[:, a:b], v[:, a:b], causal, scale)
            outs.append(o)
            lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def attention_problem(dev, B, S, Hq, Hkv, D, causal, dtype, tag):
    """Full-sequence q, k, v, dout and the float32 reference (out, dq, dk, dv)."""
    q, k, v = (rand((B, S, h, D), dtype, dev, name, tag) for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv)))
    dout = rand((B, S, Hq, D), dtype, dev, "do")
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    out_ref, _ = attention(*ref, causal, 1.0 / math.sqrt(D))
    (out_ref * dout.float()).sum().backward()
    return (q, k, v, dout), (out_ref.detach(), *(t.grad for t in ref))


def poison(t):
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:  # (bytes: fp8 rows)
        t.random_(0, 256)
    else:
        t.random_(-(2**31), 2**31 - 1)
    return t


def check_replays(call, out, replays, load, tol=TOL):
    """CUDA-graph replay check: ``load(i)`` writes replay i's inputs into the tensors ``call`` reads and
    returns the float32 reference; ``call`` (captured once, after ``load(-1)``) writes ``out``, which is
    poisoned before every replay and must be within ``tol[out.dtype]`` of the reference."""
    from triton_overlap.timing import capture

    load(-1)
    g = capture(call)
    for i in range(replays):
        ref = load(i)
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        assert err < tol[out.dtype], f"replay {i}: rel err {err:.2e}"


def check_decode_replays(block, reference, x, steps):
    """``block`` (a decode module) captured once in a CUDA graph and replayed ``steps`` times on new random inputs
    written into ``x``: each replay's output against ``reference`` on the same input in float32 (check_replays),
    without autograd, after one eager call (it sizes an AllReduce's slots, which no capture may do)."""
    out = torch.empty_like(x)

    def load(i):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + i)).to(x.device, x.dtype))
        with torch.no_grad():
            return reference(x.float())

    load(-1)
    with torch.no_grad():
        block(x)
        check_replays(lambda: out.copy_(block(x)), out, steps, load)


#: DeepSeek-V3's attention in its tensor-parallel plan, as transformers 5.25 ships it
MLA_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
            "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "layers.*.self_attn.kv_b_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise"}


def with_latent_attention_plan(config):
    """A DeepSeek-V3 ``config`` whose tensor-parallel plan has its attention's entries (MLA_PLAN): transformers
    before 5.25 (the suite's floor, 5.17) ships the plan without them."""
    if "mla_kv_a_proj" not in config.base_model_tp_plan.values():
        config.base_model_tp_plan = {**config.base_model_tp_plan, **MLA_PLAN}
    return config


class OfflineContext:
    """Enough of a Context for the ops' host-side rules (configs, tuned tables), with no process group."""

    def __init__(self, backend="host", world_size=2, rank=0):
        self.backend, self.world_size, self.rank = backend, world_size, rank
        self.interpreted = backend == "host"
        self.device = torch.device("cpu")
        self.generation = 0
        self.num_hosts = 1
        self.producer_jitter_s = 0.0
        self.resets = 0
        self._cache = {}

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def on_close(self, fn):
        pass

    def keep(self, obj):
        pass

    def op_id(self, name):
        from triton_overlap.context import op_id

        return op_id(name)


def on_hopper(pool, what, fn, *args):
    """``fn(*args)`` on every rank, where the Gluon kernel ``what`` names runs: skipped on the host backend and
    where ``fn`` returns "skip" (no compute capability 9.0, or no Gluon). Returns every rank's result."""
    import pytest

    if pool.backend == "host":
        pytest.skip("Gluon kernels do not run in Triton's interpreter")
    results = pool.run(fn, *args)
    if "skip" in results:
        pytest.skip(f"{what} needs compute capability 9.0 and Gluon")
    return results


def late_chunk_faults(ctx, flags, op, chunk, launch, first_ok=None):
    """``launch(op_id)`` as rank 0 of a simulated world of two: first with every flag up (the kernel compiled and
    the ranks in step before the fault; ``first_ok()`` then checks its output), then with rank 1's flags down: the
    call must fail naming the rank, ``op``, the peer and the chunk (``chunk``: a pattern). Every rank of the pool
    plays rank 0 and times out alike, and a fault stops every rank of the real group: a rank whose peer's fault came
    first reports that one, naming its rank, the op and the rank waited for. Returns "own" or "relayed"; the first
    rank to fault always reports its own (``assert_own_fault``)."""
    import re

    import pytest
    import torch.distributed as dist

    import triton_overlap as to

    launch(0)
    ctx.check()
    if first_ok is not None:
        first_ok()
    dist.barrier()  # not bound by timeout_s: on a loaded machine the interpreter may take longer for launch(0)
    ctx.barrier()
    flags.zero_()
    own = rf"rank 0: {op} .*timed out .*waiting for chunk {chunk} of rank 1"
    relayed_word = rf"rank 0 faulted \({op}[^:]*: waiting for chunk {chunk} of rank 1\)"
    relayed = rf"rank {ctx.rank}: rank \d+ faulted: ({relayed_word}|{own})"
    with pytest.raises(to.ContextError) as info:  # on the host backend the launch itself reports it
        launch(ctx.op_id(op))
        ctx.check()
    msg = str(info.value).removeprefix("triton_overlap: ")
    if re.match(own, msg):
        return "own"
    assert re.match(relayed, msg), msg
    return "relayed"


def assert_own_fault(results):
    assert "own" in results, f"no rank reported its own timeout: {results}"


def plain_gemm_worst(ctx, make, name, cases):
    """A one-rank GEMM, ``make(ctx, a, w, c, bias)`` returning a callable, against float32 matmul on NaN-poisoned
    outputs, each case ``(m, k, n, B as weight.t(), bias)`` called twice (the exit counts it leaves zeroed); and a
    ValueError naming ``name`` for 200 rows (not whole 128-row tiles). Returns the worst relative error."""
    import pytest

    worst = 0.0
    for m, k, n, transposed, with_bias in cases:
        a = rand((m, k), torch.bfloat16, ctx.device, name, "a", m)
        w = rand((n, k) if transposed else (k, n), torch.bfloat16, ctx.device, name, "w", m)
        w = w.t() if transposed else w
        bias = rand((n,), torch.bfloat16, ctx.device, name, "bias", m) if with_bias else None
        ref = a.float() @ w.float() + (bias.float() if with_bias else 0.0)
        c = torch.empty(m, n, dtype=torch.bfloat16, device=ctx.device)
        gemm = make(ctx, a, w, c, bias)
        for _ in range(2):
            poison(c)
            gemm()
            ctx.synchronize()
            ctx.check()
            err = rel_err(c, ref)
            assert err < TOL[torch.bfloat16], (m, k, n, transposed, err)
            worst = max(worst, err)
    odd = torch.empty(200, 64, dtype=torch.bfloat16, device=ctx.device)
    with pytest.raises(ValueError, match=name):
        make(ctx, odd, torch.empty(64, 64, dtype=torch.bfloat16, device=ctx.device), odd, None)
    return worst


def shm_files(pid=None):
    """The host backend's files in /dev/shm made by process ``pid`` (default: this one), by name. Leak checks look
    at these alone: other processes on the machine use /dev/shm too. context/host.py names each file
    ``triton_overlap-<namespace>-p<pid>-r<rank>-<n>``."""
    from triton_overlap.context.host import PREFIX, SHM

    mark = f"p{os.getpid() if pid is None else pid}"
    try:
        names = os.listdir(SHM)
    except OSError:
        return set()
    return {n for n in names if n.startswith(PREFIX) and mark in n[len(PREFIX):].split("-")}


def _same_keys(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), \
        f"{what}: keys differ: missing {sorted(set(want) - set(got))[:4]}, extra {sorted(set(got) - set(want))[:4]}"


def _same_tensors(got: dict, want: dict, what: str) -> None:
    """The same keys, and under each a tensor of the same shape, dtype and values, bit for bit."""
    _same_keys(got, want, what)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, (what, k, got[k].shape, v.shape, got[k].dtype)
        assert torch.equal(got[k].cpu(), v.cpu()), f"{what}: {k} differs"


def _same_on_rank0(got: dict, want: dict, what: str) -> None:
    """What a ``rank0_only`` gather returned: ``want`` on global rank 0 (_same_tensors), an empty dict elsewhere."""
    if torch.distributed.get_rank() == 0:
        _same_tensors(got, want, what)
    else:
        assert got == {}, sorted(got)[:4]


def check_full_state_dict(model, expected: dict, seed: int = 7):
    """``nn.full_state_dict(model)`` (a model parallelized by the styles) against ``expected``, the unmodified
    model's state dict in the parameters' dtype: the same names, shapes and dtypes, every tensor bit for bit; then
    ``load_full_state_dict`` of a changed copy (each float tensor plus noise, the same on every rank) and gathered
    again: the copy, bit for bit, whatever each rank loaded in between; then the original weights loaded back, and
    gathered to global rank 0 alone (``rank0_only``: the others get an empty dict)."""
    from triton_overlap.nn import full_state_dict, load_full_state_dict

    _same_tensors(full_state_dict(model), expected, "full_state_dict")
    g = torch.Generator().manual_seed(seed)
    changed = {k: v + torch.randn(v.shape, generator=g).to(v.dtype).to(v.device) if v.is_floating_point() else v
               for k, v in expected.items()}
    load_full_state_dict(model, changed)
    _same_tensors(full_state_dict(model, device="cpu"), changed, "after load_full_state_dict")
    load_full_state_dict(model, expected)
    _same_tensors(full_state_dict(model), expected, "loaded back")
    _same_on_rank0(full_state_dict(model, device="cpu", rank0_only=True), expected, "rank0_only")


def check_full_grads(model, reference, tol: float, scale=None) -> float:
    """``nn.full_grads(model)`` (a model parallelized by the styles, after its backward) against the gradients of
    ``reference`` (the unmodified model, after the same backward): the same names (a compiled module's
    ``_orig_mod.`` dropped) as the reference's parameters that have a gradient, the same shapes, the parameters'
    dtypes, each within ``tol`` relative to its reference gradient, or to ``scale(name)``'s norm where that gives a
    tensor (a gradient that is 0 but for rounding, measured against a related one's, as the test's own comparison
    does); then gathered to global rank 0 alone (``rank0_only``: the same there, an empty dict elsewhere). Returns
    the worst error."""
    from triton_overlap.nn import full_grads

    def names(d):
        return {k.replace("_orig_mod.", ""): v for k, v in d.items()}

    got, dtypes = names(full_grads(model)), names({k: p.dtype for k, p in model.state_dict(keep_vars=True).items()})
    want = {k: p.grad for k, p in reference.state_dict(keep_vars=True).items()
            if isinstance(p, torch.nn.Parameter) and p.grad is not None}
    _same_keys(got, want, "full_grads")
    errs = {}
    for k, v in want.items():
        assert got[k].shape == v.shape, (k, tuple(got[k].shape), tuple(v.shape))
        assert got[k].dtype == dtypes.get(k, got[k].dtype), (k, got[k].dtype, dtypes.get(k))
        other = scale(k) if scale is not None else None
        errs[k] = rel_err(got[k], v) if other is None else \
            float((got[k].double().cpu() - v.double().cpu()).norm() / other.double().cpu().norm())
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"full_grads: {worst} {errs[worst]:.2e} > {tol:.0e}"
    _same_on_rank0(names(full_grads(model, device="cpu", rank0_only=True)), got, "full_grads, rank0_only")
    return errs[worst]


@contextlib.contextmanager
def shared_directory():
    """A temporary directory every rank of the default group names (global rank 0's, removed after a barrier
    once every rank is done with it): where a DCP checkpoint goes."""
    import shutil
    import tempfile

    dist = torch.distributed
    where = [tempfile.mkdtemp(prefix="triton_overlap_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    try:
        yield where[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)


def check_resume(model, optimizer):
    """A training step resumed from a DCP checkpoint of ``model`` (parallelized by the styles, gradients in place)
    and ``optimizer``: a step, the checkpoint (``sharded_state_dict``, ``sharded_optimizer_state_dict``), a second
    step on the same gradients; then the checkpoint loaded back (``load_sharded_state_dict``,
    ``load_sharded_optimizer_state_dict``) and the second step again: the weights the first second step made, bit
    for bit (a rank loading another's shards or state would differ)."""
    import torch.distributed.checkpoint as dcp

    from triton_overlap.nn import (full_state_dict, load_sharded_optimizer_state_dict, load_sharded_state_dict,
                                   sharded_optimizer_state_dict, sharded_state_dict)

    with shared_directory() as where:
        optimizer.step()
        dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=where)
        optimizer.step()
        want = full_state_dict(model)
        state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=where)
        load_sharded_state_dict(model, state["model"])
        load_sharded_optimizer_state_dict(model, optimizer, state["optim"])
        optimizer.step()
        got = full_state_dict(model)
        bad = [k for k, v in want.items() if not torch.equal(got[k], v)]
        assert not bad, f"resumed from the checkpoint: {bad[:4]} differ"


def check_sharded_checkpoint(model, expected: dict, seed: int = 11, shards: bool = True):
    """A DCP checkpoint (torch.distributed.checkpoint) of ``model`` parallelized by the styles, through
    ``nn.sharded_state_dict``: its names and global shapes are ``expected``'s (the unmodified model's state dict);
    loaded into plain tensors of those shapes (each rank reads the whole of every tensor) it is ``expected`` bit for
    bit; a DCP checkpoint of a changed unmodified state dict (plain tensors, the same on every rank) loaded into
    ``sharded_state_dict(model)`` and ``load_sharded_state_dict`` makes ``full_state_dict(model)`` that copy bit for bit
    (DCP reads each rank's slices); the first checkpoint loaded back restores ``expected``. ``shards``: some tensor is
    saved as a ``Shard``, each a view of a parameter or of FSDP2's local tensor of one (beside FSDP2, some such view;
    a slice that narrows the dim FSDP2 splits may be a copy). Collective over the default group (DCP's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from triton_overlap.nn import full_state_dict, load_sharded_state_dict, sharded_state_dict

    with shared_directory() as where:
        styled, unmodified = f"{where}/styled", f"{where}/unmodified"
        sd = sharded_state_dict(model)
        assert sorted(sd) == sorted(expected), sorted(set(sd) ^ set(expected))[:4]
        for k, v in expected.items():
            assert sd[k].shape == v.shape and sd[k].dtype == v.dtype, (k, sd[k].shape, v.shape)
        own = model.state_dict()
        fsdp = any(isinstance(v, DTensor) and any(isinstance(p, Shard) for p in v.placements) for v in own.values())
        split = [k for k, v in sd.items() if isinstance(v, DTensor) and isinstance(v.placements[0], Shard)]
        assert split or not shards, "no tensor saved as a Shard"
        storages = {(v.to_local() if isinstance(v, DTensor) else v).untyped_storage().data_ptr() for v in own.values()}
        views = [k for k in split if sd[k].to_local().untyped_storage().data_ptr() in storages]
        # beside FSDP2 a slice that narrows the dim FSDP2 splits is gathered over FSDP2's mesh (a copy, on the
        # tensor-parallel mesh alone); every other Shard is a view of a parameter or of FSDP2's local tensor of one
        copies = [k for k in split if k not in views and not (fsdp and sd[k].device_mesh.ndim == 1)]
        assert not copies, f"Shards that are not views of a parameter: {copies[:4]}"
        assert not (fsdp and shards) or any(sd[k].device_mesh.ndim == 2 for k in views), \
            "beside FSDP2, no Shard is a view of FSDP2's local tensor"
        dcp.save(sd, checkpoint_id=styled)
        plain = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
                 for k, v in expected.items()}
        dcp.load(plain, checkpoint_id=styled)
        for k, v in expected.items():
            assert torch.equal(plain[k].cpu(), v.cpu()), f"the DCP checkpoint's {k} differs from the unmodified model's"
        g = torch.Generator().manual_seed(seed)
        changed = {k: v + torch.randn(v.shape, generator=g).to(v.dtype).to(v.device) if v.is_floating_point() else v
                   for k, v in expected.items()}
        dcp.save(changed, checkpoint_id=unmodified)
        for source, want in ((unmodified, changed), (styled, expected)):
            sd = sharded_state_dict(model)
            dcp.load(sd, checkpoint_id=source)
            load_sharded_state_dict(model, sd)
            got = full_state_dict(model, device="cpu")
            bad = [k for k, v in want.items() if not torch.equal(got[k], v.cpu())]
            assert not bad, f"loaded from {source.rsplit('/', 1)[1]}: {bad[:4]} differ"


def check_grad_clipping(model, reference, grad_errors, tol: float):
    """``nn.grad_norm(model)`` (a model parallelized by the styles or layers, after backward) against torch's norm
    of ``reference``'s gradients (the unmodified model's), orders 2, 1 and inf, within ``tol`` relative; then both
    clipped to half that 2-norm (``nn.clip_grad_norm_`` and torch's) and every gradient compared again by
    ``grad_errors()`` (the test's own comparison: name -> relative error), within ``tol``. A rank clipping by
    another factor than the unmodified model's fails the second check."""
    from triton_overlap.nn import clip_grad_norm_, grad_norm

    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    want = {}
    for q in (2.0, 1.0, float("inf")):
        got, want[q] = float(grad_norm(model, q)), float(torch.nn.utils.get_total_norm(grads, q))
        assert abs(got - want[q]) <= tol * want[q], f"grad_norm of order {q}: {got} against {want[q]}"
    max_norm = want[2.0] / 2
    total = float(clip_grad_norm_(model, max_norm))
    assert abs(total - want[2.0]) <= tol * want[2.0], (total, want[2.0])
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    bad = {k: f"{e:.2e}" for k, e in grad_errors().items() if e > tol}
    assert not bad, f"after clip_grad_norm_: {bad}"
