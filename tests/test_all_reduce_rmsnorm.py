"""AllReduce + residual add + RMSNorm: both outputs against a float64 reference (the sum over ranks, the residual,
the norm and the weight), into poisoned outputs, at odd M and H, in bf16, fp16 and fp32, with the residual updated
in place; every rank's outputs the same bits; bad input; the fallback paths; CUDA-graph replays on GPUs (from the
contract, tests/contract.py)."""
from dataclasses import dataclass

import pytest
import torch

import contract
import triton_overlap as to
from contract import Call, Cases, OpSpec, Variants
from refs import exact_inputs, poison, rand, rel_err
from triton_overlap.ops.all_reduce_rmsnorm import TAGGED_MAX_BYTES

#: ||out - ref|| / ||ref|| against float64: the residual is rounded to the dtype once, and the norm (of the rounded
#: residual) once more
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class RMSCase:
    """Every rank's [m, h] ``x`` summed over ranks, plus ``residual``, normalised with ``weight`` (of
    ``weight_dtype``, default the inputs' dtype); ``in_place``: the residual updated in place; ``iters`` calls;
    ``flags``: over plain slots and a flag per row at any size (tagged_max_bytes=0), else the op's default."""
    m: int
    h: int
    dtype: str = "bfloat16"
    weight_dtype: str | None = None
    in_place: bool = False
    iters: int = 1
    fallback: str = "never"
    flags: bool = False


def _inputs(ctx, case, it):
    dtype, dev = getattr(torch, case.dtype), ctx.device
    xs = [rand((case.m, case.h), dtype, dev, "arn-x", it, r) for r in range(ctx.world_size)]
    residual = rand((case.m, case.h), dtype, dev, "arn-r", it)
    weight = rand((case.h,), getattr(torch, case.weight_dtype or case.dtype), dev, "arn-w", it)
    h = residual.double() + sum(x.double() for x in xs)
    normed = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS) * weight.double()
    kwargs = dict(eps=EPS, residual_out=residual if case.in_place else poison(torch.empty_like(residual)))
    return Call((xs[ctx.rank], residual, weight), kwargs, normed, torch.empty_like(residual), dict(residual=h))


def _check_residual(ctx, op, case, call, result):
    normed, new_residual = result
    assert new_residual.data_ptr() == call.kwargs["residual_out"].data_ptr()
    err = rel_err(new_residual, call.expect["residual"])
    assert err < TOL[new_residual.dtype], f"rank {ctx.rank}: new_residual rel err {err:.2e}"


def _bad_inputs(ctx):
    op = to.AllReduceRMSNorm(ctx, fallback="never")
    dev = ctx.device
    x, res, w = (torch.ones(3, 8, device=dev), torch.ones(3, 8, device=dev), torch.ones(8, device=dev))
    bf = torch.ones(3, 8, dtype=torch.bfloat16, device=dev)
    bad = [
        ("torch.Tensor", lambda: op([1.0], res, w, eps=EPS)),
        ("2-D", lambda: op(torch.ones(8, device=dev), torch.ones(8, device=dev), w, eps=EPS)),
        ("float32, float16 or bfloat16", lambda: op(x.int(), res.int(), w, eps=EPS)),
        ("residual must be", lambda: op(x, torch.ones(3, 9, device=dev), w, eps=EPS)),
        ("residual must be", lambda: op(x, bf, w, eps=EPS)),
        ("weight must be", lambda: op(x, res, torch.ones(9, device=dev), eps=EPS)),
        ("weight must be", lambda: op(bf, bf, torch.ones(8, dtype=torch.float16, device=dev), eps=EPS)),
        ("eps", lambda: op(x, res, w, eps=float("nan"))),
        ("eps", lambda: op(x, res, w, eps=-1.0)),
        ("non-contiguous", lambda: op(x, res, w, eps=EPS, out=torch.empty(3, 16, device=dev)[:, ::2])),
        ("residual_out must be a contiguous", lambda: op(x, res, w, eps=EPS, residual_out=bf)),
        ("out must not be", lambda: op(x, res, w, eps=EPS, out=x)),
        ("residual_out must not be x", lambda: op(x, res, w, eps=EPS, residual_out=x)),
        ("is on", lambda: op(x, res, w.to("meta"), eps=EPS)),
        ("too large", lambda: op(torch.ones(1, 16385, device=dev), torch.ones(1, 16385, device=dev),
                                 torch.ones(16385, device=dev), eps=EPS)),
        ("ranks disagree", lambda: op(torch.ones(3 + ctx.rank, 8, device=dev), torch.ones(3 + ctx.rank, 8, device=dev),
                                      w, eps=EPS)),
    ]
    return op, bad, ALL_REDUCE_RMSNORM.inputs(ctx, RMSCase(m=3, h=24), "good")


ALL_REDUCE_RMSNORM = OpSpec(
    name="all_reduce_rmsnorm", module=__name__, op=to.AllReduceRMSNorm, functional=to.all_reduce_rmsnorm,
    inputs=_inputs, tol=TOL, check=_check_residual, bad_inputs=_bad_inputs,
    make=lambda ctx, case, fallback: to.AllReduceRMSNorm(ctx, fallback=fallback,
                                                         **(dict(tagged_max_bytes=0) if case.flags else {})),
    cases=Cases(host=(RMSCase(m=1, h=24), RMSCase(m=3, h=40, dtype="float32"), RMSCase(m=17, h=24, iters=2),
                      RMSCase(m=5, h=40, dtype="float16", weight_dtype="float32", in_place=True),
                      RMSCase(m=3, h=40, fallback="always"), RMSCase(m=2, h=23), RMSCase(m=4, h=40, flags=True),
                      RMSCase(m=3, h=23, flags=True, weight_dtype="float32"),
                      RMSCase(m=2, h=23, weight_dtype="float32")),
                gpu=(RMSCase(m=1, h=4096), RMSCase(m=64, h=8192, iters=3), RMSCase(m=17, h=5000, dtype="float32"),
                     RMSCase(m=3, h=16384, weight_dtype="float32", in_place=True), RMSCase(m=2, h=4096, flags=True),
                     RMSCase(m=3, h=4100, flags=True), RMSCase(m=1, h=1000, dtype="float32"))),
    # 1,000 replays, on tagged words and on rows with flags (16 rows of 8192: launched as a programmatic dependent;
    # 64: not); the first call sizes the slots, not allowed inside a capture
    replay=Variants(host=None, gpu=RMSCase(m=7, h=4096), calls=1000, warm=True,
                    ids={"tagged": {}, "flags_16": dict(m=16, h=8192), "flags_64": dict(m=64, h=8192)}),
)

# the contract's tests: matches_reference, bad_input_raises_before_launch, cuda_graph_replay
globals().update(contract.tests(ALL_REDUCE_RMSNORM))


def _same_bits():
    """Calls of changing shapes and dtypes on one op: every rank's outputs, for the comparison across ranks."""
    with to.Context(timeout_s=30) as ctx:
        op = to.AllReduceRMSNorm(ctx, fallback="never")
        digests = []
        for i, (m, h, dtype) in enumerate([(3, 40, "bfloat16"), (17, 24, "float32"), (1, 40, "bfloat16"),
                                           (4, 24, "float16")]):
            call = _inputs(ctx, RMSCase(m=m, h=h, dtype=dtype), ("bits", i))
            normed, new_residual = op(*call.args, **call.kwargs)
            ctx.check()
            assert rel_err(normed, call.ref) < TOL[normed.dtype]
            digests.append((normed.float().tolist(), new_residual.float().tolist()))
        return digests


def test_all_reduce_rmsnorm_same_bits_on_every_rank(pool):
    results = pool.run(_same_bits)
    assert all(r == results[0] for r in results), "ranks' outputs differ"


def _eps_disagree():
    """Ranks that pass different ``eps`` would norm alike sums differently: ValueError on every rank, the first
    time (the agreement on shapes holds it), and the Context stays usable."""
    with to.Context(timeout_s=30) as ctx:
        op = to.AllReduceRMSNorm(ctx, fallback="never")
        call = _inputs(ctx, RMSCase(m=3, h=24, dtype="float32"), "eps")
        with pytest.raises(ValueError, match="ranks disagree"):
            op(*call.args, **dict(call.kwargs, eps=EPS * (1 + ctx.rank)))
        normed, _ = op(*call.args, **call.kwargs)
        ctx.check()
        assert rel_err(normed, call.ref) < TOL[normed.dtype]
        return True


def test_all_reduce_rmsnorm_eps_must_agree(pool):
    assert all(pool.run(_eps_disagree))


def _exact_residual(shapes, tagged_max_bytes: int, iters: int):
    """The new residual, call after call with new inputs, over tagged words, over flagged rows and over both by turns
    on one op (``tagged_max_bytes`` between the shapes' sizes: one call count for both kernels), equals torch's
    float32 sum of every rank's x in rank order plus the residual, rounded once, to the bit (what the kernels
    compute): a value taken from a slot before it held this call's would show. Small whole numbers on the host
    backend (refs.exact_inputs)."""
    with to.Context(timeout_s=30) as ctx:
        ops = [to.AllReduceRMSNorm(ctx, fallback="never", name=f"arn.{limit}", tagged_max_bytes=limit)
               for limit in (1 << 30, 0, tagged_max_bytes)]  # tagged words, flagged rows, both kernels by turns
        whole, dtype = ctx.interpreted, torch.bfloat16
        for i in range(iters):
            for op, (m, h) in ((op, shape) for op in ops for shape in shapes):
                xs = [exact_inputs((m, h), dtype, ctx.device, whole, "exact", i, r) for r in range(ctx.world_size)]
                residual = exact_inputs((m, h), dtype, ctx.device, whole, "exact-r", i)
                weight = rand((h,), dtype, ctx.device, "exact-w", i)
                want = xs[0].float()
                for x in xs[1:]:
                    want = want + x.float()
                want = (want + residual.float()).to(dtype)
                _, got = op(xs[ctx.rank], residual, weight, eps=EPS, residual_out=poison(torch.empty_like(residual)))
                ctx.check()
                assert torch.equal(got, want), (i, m, h)
        return True


def test_all_reduce_rmsnorm_residual_is_exact(pool):
    host = pool.backend == "host"
    # bf16 sizes: host 240 and 92 bytes, GPU 8 KiB to 1 MiB (the default tagged_max_bytes falls between)
    shapes = [(3, 40), (2, 23)] if host else [(1, 4096), (16, 4096), (64, 4096), (64, 8192), (5, 4100)]
    limit = 128 if host else TAGGED_MAX_BYTES
    assert all(pool.run(_exact_residual, shapes, limit, 2 if host else 20))


def _paths():
    """fallback="auto" takes the kernel up to ``max_bytes`` and the process group above it (through the op and the
    functional form, which has the default limit); "always" the process group, "never" the kernel; all right."""
    with to.Context(timeout_s=30) as ctx:
        case = RMSCase(m=3, h=40)
        call = _inputs(ctx, case, "paths")
        args, eps = call.args, call.kwargs["eps"]
        runs = []
        for fallback, max_bytes, path in (("auto", 1 << 20, "overlap"), ("auto", 64, "fallback"),
                                          ("always", 1 << 20, "fallback"), ("never", 64, "overlap")):
            op = to.AllReduceRMSNorm(ctx, fallback=fallback, max_bytes=max_bytes)
            runs.append(op(*args, eps=eps))
            assert op.last_path == path, (fallback, max_bytes, op.last_path)
        runs.append(to.all_reduce_rmsnorm(*args, eps=eps, ctx=ctx))
        assert to.AllReduceRMSNorm.shared(ctx).last_path == ("fallback" if ctx.world_size == 1 else "overlap")
        # rows longer than one program holds: "auto" takes the process group
        big = _inputs(ctx, RMSCase(m=1, h=16385, dtype="float32"), "big")
        op = to.AllReduceRMSNorm(ctx, max_bytes=1 << 30)
        normed, new_residual = op(*big.args, eps=eps)
        assert op.last_path == "fallback"
        ctx.check()
        assert rel_err(normed, big.ref) < TOL[torch.float32]
        assert rel_err(new_residual, big.expect["residual"]) < TOL[torch.float32]
        for normed, new_residual in runs:
            assert rel_err(normed, call.ref) < TOL[normed.dtype]
            assert rel_err(new_residual, call.expect["residual"]) < TOL[normed.dtype]
        assert torch.equal(args[1], _inputs(ctx, case, "paths").args[1]), "the residual was modified"
        dev = ctx.device
        empty = op(torch.ones(0, 8, device=dev), torch.ones(0, 8, device=dev), torch.ones(8, device=dev), eps=eps)
        assert empty[0].shape == empty[1].shape == (0, 8)
        return True


def test_all_reduce_rmsnorm_fallback_paths(pool):
    assert all(pool.run(_paths))


def _fp8_out(shapes):
    """out_dtype=float8_e4m3fn on the kernel and on the process group: the residual as in 16 bits, each row's scale
    its largest magnitude over 448 (which the fp8 row then reaches), ``normed * scale`` the norm within fp8's
    rounding (e4m3: 3 mantissa bits, a relative step of at most 2^-4 per element) on both paths (whose float32
    norms differ in the last bits: rsqrt against 1 / sqrt); every rank's outputs for the comparison across ranks."""
    with to.Context(timeout_s=30) as ctx:
        digests = []
        for fallback in ("never", "always"):
            op = to.AllReduceRMSNorm(ctx, fallback=fallback)
            for i, (m, h) in enumerate(shapes):
                call = _inputs(ctx, RMSCase(m=m, h=h), ("fp8", i))
                kwargs = dict(call.kwargs, out=poison(torch.empty(m, h, dtype=torch.float8_e4m3fn, device=ctx.device)))
                normed, new_residual, scales = op(*call.args, out_dtype=torch.float8_e4m3fn, **kwargs)
                ctx.check()
                assert op.last_path == ("fallback" if fallback == "always" else "overlap")
                assert normed.dtype == torch.float8_e4m3fn and normed.data_ptr() == kwargs["out"].data_ptr()
                assert scales.dtype == torch.float32 and scales.shape == (m, 1)
                assert rel_err(new_residual, call.expect["residual"]) < TOL[torch.bfloat16]
                ref = call.ref
                assert rel_err(scales, ref.abs().amax(-1, keepdim=True) / 448) < TOL[torch.bfloat16]
                assert torch.equal(normed.float().abs().amax(-1), torch.full((m,), 448.0, device=ctx.device))
                err = rel_err(normed.float() * scales, ref)
                assert err < 0.05, f"rank {ctx.rank}: dequantised norm rel err {err:.3f}"
                digests.append((normed.view(torch.uint8).tolist(), scales.tolist()))
        with pytest.raises(ValueError, match="out_dtype must be"):
            op(*call.args, eps=EPS, out_dtype=torch.float16)
        assert len(op(*call.args, eps=EPS, out_dtype=call.args[0].dtype)) == 2  # x's dtype: as without
        with pytest.raises(ValueError, match="out must be a contiguous torch.float8_e4m3fn"):
            op(*call.args, eps=EPS, out_dtype=torch.float8_e4m3fn, out=torch.empty_like(call.args[0]))
        return digests


def test_all_reduce_rmsnorm_fp8_out(pool):
    shapes = [(3, 40), (1, 24), (6, 72), (2, 23)] if pool.backend == "host" else [(16, 4096), (1, 8192), (64, 5120),
                                                                                  (2, 4100)]
    results = pool.run(_fp8_out, shapes)
    assert all(r == results[0] for r in results), "ranks' outputs differ"


def test_all_reduce_rmsnorm_is_exported():
    assert to.all_reduce_rmsnorm in vars(to).values() and "AllReduceRMSNorm" in to.__all__
    with pytest.raises(ValueError, match="fallback"):
        to.AllReduceRMSNorm(None, fallback="sometimes")


def _row_layer_rmsnorm(m, n_in, n_out):
    """RowParallelLinear.forward_rmsnorm (the local GEMM, then AllReduce + residual + RMSNorm in one kernel) against
    float64: the unsharded linear layer's output plus the residual, normalised; [2, m, *] leading dims kept; the
    residual not modified; the same bits on every rank."""
    from triton_overlap.nn import RowParallelLinear

    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        torch.manual_seed(7)
        full = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            for p in full.parameters():
                p.copy_(p.bfloat16().float())
        layer = RowParallelLinear.from_full_weight(full, ctx, dtype=torch.bfloat16, sequence_parallel=False,
                                                   fallback="never")
        x = rand((2, m, n_in), torch.bfloat16, dev, "rl-x")
        residual = rand((2, m, n_out), torch.bfloat16, dev, "rl-r")
        norm_w = rand((n_out,), torch.bfloat16, dev, "rl-w")
        keep = residual.clone()
        k = n_in // W
        normed, new_residual = layer.forward_rmsnorm(x[..., r * k:(r + 1) * k], residual, norm_w, eps=EPS)
        ctx.check()
        h = residual.double() + x.double() @ full.weight.double().t().to(dev) + full.bias.double().to(dev)
        ref = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS) * norm_w.double()
        assert normed.shape == new_residual.shape == (2, m, n_out) and normed.dtype == torch.bfloat16
        assert torch.equal(residual, keep), "the residual was modified"
        errs = (rel_err(normed, ref), rel_err(new_residual, h))
        assert max(errs) < 2e-2, errs
        return normed.float().cpu(), new_residual.float().cpu()


def test_row_parallel_forward_rmsnorm(pool):
    sizes = (3, 48, 40) if pool.backend == "host" else (5, 2048, 4096)
    results = pool.run(_row_layer_rmsnorm, *sizes)
    assert all(torch.equal(a[0], results[0][0]) and torch.equal(a[1], results[0][1]) for a in results)
