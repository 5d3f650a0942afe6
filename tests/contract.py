"""The contract every op's tests share. An op's test file declares the op once, as an OpSpec with its cases, and
gets the cross-cutting tests from here:

    AG_GEMM = OpSpec(name="ag_gemm", module=__name__, op=to.AllGatherGEMM, inputs=_inputs, cases=Cases(...), ...)
    globals().update(contract.tests(AG_GEMM))

Cases are frozen dataclasses with named fields and defaults (a case names what it changes). Fields the contract
reads where a case has them: ``iters`` (calls per case, 1), ``jitter`` (producer delays in s, 0.0) and ``fallback``
(the op's rule, "never"; "always" expects the fallback path). The spec says how to make the op and one call's inputs
on a rank (``inputs(ctx, case, it)`` -> Call: arguments, an output to poison and pass as ``out=``, the float32 or
float64 reference); the tolerance; hooks for what differs (workspaces filled with garbage before a call, checks of
its own after each call and after a case); and which contracts apply. ``tests(spec)`` returns, by name (pytest
collects them under it, so test ids read ``test_<name>_<contract>[...]``):

- ``test_<name>_matches_reference[i]``: case i of the backend's list (host or GPU), ``iters`` calls on one op into
  poisoned outputs, each against the reference; the path taken; the cut of ``harness.host_case_share`` (the
  spec's ``reference`` names the reference in test names: ``test_cp_attention_matches_full_sequence``);
- ``test_<name>_gradients_match_reference[i]`` (``grad_cases``): the op through autograd, this rank's inputs'
  gradients against float32 autograd on the unsharded computation;
- ``test_<name>_<key>`` for each of ``large_cases``: the same on every backend, at W = 2 only on the host backend;
- ``test_<name>_100_back_to_back_calls[variant]`` (``back_to_back``): 100 calls without host synchronisation (an
  eighth on the host backend, ``harness.stress_rounds``), every output checked after one synchronisation;
- ``test_<name>_bad_input_raises_before_launch`` (``bad_inputs``): each bad call raises ValueError naming what is
  wrong, ranks that disagree on shapes get it on every rank, and the op and Context still work after;
- ``test_<name>_small_shapes_fall_back`` (``falls_back``): fallback="auto" (through the functional form) takes
  the fallback path on small shapes, "always" too, "never" overlaps; all right;
- ``test_<name>_cuda_graph_replay[variant]`` (``replay``): a call captured in a CUDA graph and replayed with new
  inputs (GPUs only).

Each test body runs on every rank (``pool.run(fn, *args)`` pickles a module-level function and its arguments): a
spec pickles as its module and name, and a rank finds it again in ``SPECS`` after importing that module. The
bodies (``matches_reference``, ``gradients_match``, ``back_to_back``, ...) are plain functions of a spec and a case,
for other tests to run under other conditions: test_topology runs the ops' cases under virtual hosts, and the fault
bodies ``peer_absent`` and ``shapes_disagree`` (on a spec's ``faults`` call) run in test_faults and test_topology.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
import torch

import triton_overlap as to
from harness import host_case_share, stress_rounds
from refs import GRAD_TOL, TOL, check_replays, poison, rel_err

#: every OpSpec by name, filled as the modules that declare them are imported
SPECS: dict[str, OpSpec] = {}

#: the faults' timeouts: short, to keep the suite quick (GPUs build kernels on a shape's first call: longer)
TIMEOUT_S = 1.5
GPU_TIMEOUT_S = 6.0
#: what a fault may take beyond its timeout on a loaded machine
SLACK_S = 4.0
#: the earliest a call's wait gives up, as a share of T: the barrier's (context.BARRIER_SHARE, 0.9), less the host
#: backend's millisecond clock's lag
EARLIEST = 0.85


@dataclass(frozen=True, kw_only=True)
class GemmCase:
    """What the GEMM ops' cases share: ``k`` and ``n`` of each rank's weight (``transposed``: the transpose of an
    [n, k] tensor, as nn.Linear keeps it), ``dtype``, ``bias``, ``iters`` calls on one op with producers delayed at
    random up to ``jitter`` s, and the call's config where set (None: the op's own): ``m_per_chunk``, ``streams``
    (num_streams), ``tma``, ``gemm``."""
    k: int
    n: int
    dtype: str = "bfloat16"
    bias: bool = False
    transposed: bool = False
    iters: int = 1
    jitter: float = 0.0
    m_per_chunk: int | None = None
    streams: int | None = None
    tma: bool | None = None
    gemm: str | None = None


def set_fields(**fields) -> dict:
    """The config fields (or call arguments) a case sets: those not None."""
    return {k: v for k, v in fields.items() if v is not None}


def gemm_weight(case, make, *seed) -> torch.Tensor:
    """A case's [k, n] weight from ``make(shape, *seed)``, or the transpose of an [n, k] one (``case.transposed``)."""
    w = make((case.n, case.k) if case.transposed else (case.k, case.n), *seed)
    return w.t() if case.transposed else w


@dataclass(frozen=True)
class Call:
    """One call of an op on this rank: ``op(*args, **kwargs)``, with ``out=out`` where the contract passes an output
    (it poisons it first and checks the result is it). ``ref``: the reference of the output (float32 or float64);
    ``expect``: what a spec's own check compares besides (the gathered rows)."""
    args: tuple
    kwargs: dict
    ref: torch.Tensor
    out: torch.Tensor | None = None
    expect: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GradCall:
    """One call through autograd on this rank: ``op(*inputs.values(), **kwargs)``, its output's gradient
    ``grad_out``, and the reference gradient of each input (by name)."""
    inputs: dict
    kwargs: dict
    grad_out: torch.Tensor
    grads: dict


@dataclass(frozen=True)
class Cases:
    """Cases by backend: ``host`` on the host backend (kernels interpreted), ``gpu`` on the others."""
    host: tuple = ()
    gpu: tuple = ()

    def on(self, pool) -> tuple:
        return self.host if pool.backend == "host" else self.gpu


@dataclass(frozen=True)
class Faults:
    """What the fault bodies call: ``case``, a small call every rank makes; ``rows(case, n)``: that call with n rows
    per rank (ranks that pass different shapes); ``header(case)``: how a mismatch names that call (the op and the
    dimensions its call header carries, e.g. "ag_gemm 8 32")."""
    case: object
    rows: Callable
    header: Callable


@dataclass(frozen=True)
class Variants:
    """One case per backend (None: the test skips there), run once per variant: ``ids`` maps a variant's test id
    to the case fields it sets (no ids: one test); ``host_skips`` maps ids the host backend skips to why.
    ``calls``: how many calls (or replays) the contract makes; ``warm``: one eager call before a capture (an op
    that sizes its workspaces on a call cannot allocate them inside a capture)."""
    host: object | None
    gpu: object | None
    calls: int
    ids: Mapping[str, Mapping] = field(default_factory=dict)
    host_skips: Mapping[str, str] = field(default_factory=dict)
    warm: bool = False

    def case(self, pool, variant: str | None, why_not_host: str):
        case = self.host if pool.backend == "host" else self.gpu
        if case is None:
            pytest.skip(why_not_host)
        if pool.backend == "host" and variant in self.host_skips:
            pytest.skip(self.host_skips[variant])
        return dataclasses.replace(case, **self.ids[variant]) if variant is not None else case


def _load(module: str, name: str) -> OpSpec:
    importlib.import_module(module)
    return SPECS[name]


@dataclass(frozen=True, eq=False)
class OpSpec:
    """An op as its tests see it.

    ``name``: the op's name, which begins its tests' names; ``module``: the module that declares the spec
    (``__name__``). ``op``: the op's class (``op(ctx, fallback=...)`` makes one unless ``make(ctx, case,
    fallback)`` is given); ``functional``: its functional form (``fn(*args, ctx=ctx, **kwargs)``, on
    ``op.shared(ctx)``). ``inputs(ctx, case, it)`` -> Call: call ``it``'s inputs on this rank (every rank rebuilds
    every rank's inputs: ``refs.rand``). ``tol``: the relative error allowed, by output dtype. ``stale(ctx, op,
    case, it)``: write garbage where the call must not read (workspaces) before call ``it``; ``check(ctx, op, case,
    call, result)``: the spec's own assertions after each call; ``finish(ctx, op, case)``: after a case's calls.
    ``paths``: whether the op reports ``last_path`` ("overlap" or "fallback"), which the contract checks.
    ``reference``: what the reference is called in test names.

    The contracts that apply (None: not this op's): ``cases`` (the reference cases), ``large_cases``,
    ``back_to_back``, ``bad_inputs(ctx)`` -> (op, [(message, bad call)], a good Call for the op after them),
    ``falls_back`` (Cases of small shapes), ``replay``; ``grad_cases`` with ``grad_inputs(ctx, case)`` -> GradCall,
    ``grad_tol`` and ``after_forward(ctx, op, case, result)`` (between the forward and the backward); ``faults``
    (Faults: the calls of the fault bodies, ``peer_absent`` and ``shapes_disagree``, which tests/test_faults.py and
    tests/test_topology.py run)."""
    name: str
    module: str
    op: type
    inputs: Callable
    cases: Cases | None = None
    make: Callable | None = None
    functional: Callable | None = None
    tol: Mapping = field(default_factory=lambda: dict(TOL))
    stale: Callable | None = None
    check: Callable | None = None
    finish: Callable | None = None
    paths: bool = True
    reference: str = "reference"
    large_cases: Mapping = field(default_factory=dict)
    back_to_back: Variants | None = None
    bad_inputs: Callable | None = None
    falls_back: Cases | None = None
    replay: Variants | None = None
    grad_cases: Cases | None = None
    grad_inputs: Callable | None = None
    grad_tol: Mapping = field(default_factory=lambda: dict(GRAD_TOL))
    after_forward: Callable | None = None
    faults: Faults | None = None

    def __post_init__(self):
        known = SPECS.get(self.name)
        if known is not None and known.module != self.module:
            raise ValueError(f"two specs named {self.name!r}: in {known.module} and {self.module}")
        SPECS[self.name] = self

    def __reduce__(self):  # a rank imports the declaring module and takes the spec from SPECS
        return _load, (self.module, self.name)

    def __repr__(self):
        return f"OpSpec({self.name!r})"

    def new_op(self, ctx, case, fallback: str):
        return self.make(ctx, case, fallback) if self.make else self.op(ctx, fallback=fallback)

    def error(self, result, ref) -> tuple[float, float]:
        """(relative error, the tolerance) of ``result`` (an op's output, or a tuple that begins with it)."""
        got = output(result)
        return rel_err(got, ref), self.tol[got.dtype]


def output(result) -> torch.Tensor:
    """The output of an op's result: itself, or the first of a tuple (out, gathered rows; out, lse)."""
    return result[0] if isinstance(result, tuple) else result


# ------------------------------------------------------------------------------------ bodies, run on every rank
def matches_reference(spec: OpSpec, case):
    """``case``'s calls on one op, each into a poisoned output (and after the spec's garbage where the call must
    not read), against the reference; the result is the output passed in; the op took the path its rule names.
    Returns the worst relative error."""
    fallback = getattr(case, "fallback", "never")
    with to.Context(timeout_s=120) as ctx:
        ctx.set_producer_jitter(getattr(case, "jitter", 0.0))
        op = spec.new_op(ctx, case, fallback)
        errs = []
        for it in range(getattr(case, "iters", 1)):
            call = spec.inputs(ctx, case, it)
            if spec.stale is not None:
                spec.stale(ctx, op, case, it)
            kwargs = call.kwargs if call.out is None else dict(call.kwargs, out=poison(call.out))
            result = op(*call.args, **kwargs)
            ctx.check()
            if call.out is not None:
                assert output(result).data_ptr() == call.out.data_ptr(), "the result is not the out passed"
            if spec.check is not None:
                spec.check(ctx, op, case, call, result)
            err, tol = spec.error(result, call.ref)
            errs.append(err)
            assert err < tol, f"rank {ctx.rank} iter {it}: rel err {err:.2e}"
        if spec.paths:
            assert op.last_path == ("fallback" if fallback == "always" else "overlap"), op.last_path
        if spec.finish is not None:
            spec.finish(ctx, op, case)
        return max(errs)


def gradients_match(spec: OpSpec, case):
    """The op through autograd: the gradients of this rank's inputs (of the output times ``grad_out``, summed)
    against the float32 reference, within ``spec.grad_tol`` (each rank's share within it: so is the whole).
    Returns the relative errors by input."""
    with to.Context(timeout_s=120) as ctx:
        op = spec.new_op(ctx, case, "never")
        call = spec.grad_inputs(ctx, case)
        leaves = {name: t.requires_grad_() for name, t in call.inputs.items()}
        result = op(*leaves.values(), **call.kwargs)
        if spec.after_forward is not None:
            spec.after_forward(ctx, op, case, result)
        (output(result).float() * call.grad_out.float()).sum().backward()
        ctx.check()
        errs = {name: rel_err(t.grad, call.grads[name]) for name, t in leaves.items()}
        bad = {name: e for name, e in errs.items() if e > spec.grad_tol[leaves[name].dtype]}
        assert not bad, f"rank {ctx.rank}: gradient rel err {bad}"
        return errs


def back_to_back(spec: OpSpec, case, n_calls: int):
    """``n_calls`` calls with no host synchronisation between them (each with new inputs, the op allocating the
    output), then every output against its reference. Returns the worst relative error."""
    with to.Context(timeout_s=120) as ctx:
        op = spec.new_op(ctx, case, "never")
        done = []
        for i in range(n_calls):  # no host synchronisation between calls
            call = spec.inputs(ctx, case, i)
            done.append((op(*call.args, **call.kwargs), call.ref))
        ctx.synchronize()
        ctx.check()
        worst = 0.0
        for i, (result, ref) in enumerate(done):
            err, tol = spec.error(result, ref)
            assert err < tol, f"rank {ctx.rank} call {i}: rel err {err:.2e}"
            worst = max(worst, err)
        return worst


def refuses_bad_input(spec: OpSpec):
    """Each of the spec's bad calls raises ValueError matching its message (before any launch: ranks that disagree
    on shapes all get it, none hangs), and then the op and the Context still work."""
    with to.Context(timeout_s=30) as ctx:
        op, bad, good = spec.bad_inputs(ctx)
        for message, call in bad:
            before = int(ctx.call_number.item())
            with pytest.raises(ValueError, match=message):
                call()
            assert int(ctx.call_number.item()) == before, f"{message}: the call passed a barrier before raising"
        result = op(*good.args, **good.kwargs)  # and the op and Context still work
        ctx.check()
        err, tol = spec.error(result, good.ref)
        assert err < tol, f"rank {ctx.rank}: after the bad calls: rel err {err:.2e}"
        return True


def falls_back(spec: OpSpec, cases: tuple):
    """Each small case: fallback="auto" through the functional form takes the fallback path (torch.distributed +
    torch), "always" too, "never" overlaps; every result against the reference."""
    with to.Context(timeout_s=30) as ctx:
        for case in cases:
            call = spec.inputs(ctx, case, 0)
            got = spec.functional(*call.args, ctx=ctx, **call.kwargs)  # "auto": the small shape falls back
            assert spec.op.shared(ctx).last_path == "fallback", (case, spec.op.shared(ctx).last_path)
            runs = [("auto", got)]
            for fallback, path in (("always", "fallback"), ("never", "overlap")):
                op = spec.new_op(ctx, case, fallback)
                runs.append((fallback, op(*call.args, **call.kwargs)))
                assert op.last_path == path, (case, fallback, op.last_path)
            ctx.check()
            for fallback, result in runs:
                err, tol = spec.error(result, call.ref)
                assert err < tol, f"rank {ctx.rank} {case} fallback={fallback!r}: rel err {err:.2e}"
        return True


def _copy_tensors(dst, src):
    for d, s in zip(dst, src):
        if isinstance(d, torch.Tensor):
            d.copy_(s)


def graph_replays(spec: OpSpec, case, replays: int, warm: bool = False):
    """A call captured in a CUDA graph (refs.check_replays), replayed ``replays`` times, each after new inputs are
    copied into every tensor the captured call reads (scales included) and its output poisoned. ``warm``: one eager
    call first (it sizes the op's workspaces: not allowed inside a capture)."""
    with to.Context(timeout_s=30) as ctx:
        op = spec.new_op(ctx, case, "never")
        first = spec.inputs(ctx, case, -1)
        names = sorted(first.kwargs)
        if warm:
            op(*first.args, out=first.out, **first.kwargs)
            ctx.check()

        def load(i):
            call = spec.inputs(ctx, case, i)
            _copy_tensors(first.args, call.args)
            _copy_tensors([first.kwargs[k] for k in names], [call.kwargs[k] for k in names])
            return call.ref

        check_replays(lambda: op(*first.args, out=first.out, **first.kwargs), first.out, replays, load, spec.tol)
        ctx.check()
        return True


# ------------------------------------------------------------------------------------ faults
def timeout_for(pool) -> float:
    return TIMEOUT_S if pool.backend == "host" else GPU_TIMEOUT_S


def correct(spec: OpSpec, op, ctx, case, tag=0):
    """One call of ``case`` (inputs ``tag``) on ``op``, checked against its reference."""
    call = spec.inputs(ctx, case, tag)
    result = op(*call.args, **call.kwargs)
    ctx.check()
    err, tol = spec.error(result, call.ref)
    assert err < tol, f"rank {ctx.rank} {case}: rel err {err:.2e}"


def timed(ctx, fn):
    """``fn()`` and ``ctx.check()`` must raise a ContextError: its text, and the time it took."""
    t0 = time.monotonic()
    with pytest.raises(to.ContextError) as info:
        fn()
        ctx.check()
    return str(info.value), time.monotonic() - t0


def refused(spec: OpSpec, op, ctx, case, text):
    """The faulted Context refuses a call at once (before any of its waits could give up), with the first fault's
    text."""
    call = spec.inputs(ctx, case, 0)
    t0 = time.monotonic()
    with pytest.raises(to.ContextError, match="reset") as info:
        op(*call.args, **call.kwargs)
    elapsed = time.monotonic() - t0
    assert text in str(info.value) and elapsed < ctx.timeout_s * EARLIEST, (elapsed, str(info.value))


def relayed(msg: str) -> bool:
    """Whether a fault's text is a peer's fault relayed to this rank (which may come before this rank's own wait
    would have given up: the peer started its wait earlier), rather than this rank's own."""
    return re.search(r"rank \d+ faulted: ", msg) is not None


def in_time(msg: str, elapsed: float, T: float) -> bool:
    """A fault came within its time: this rank's own wait gives up no earlier than ``T * EARLIEST``; a relayed one
    may come at any time before; both by ``T + SLACK_S``."""
    return (relayed(msg) or T * EARLIEST <= elapsed) and elapsed <= T + SLACK_S


def timed_all_but_rank_1(times: list) -> None:
    """The fault bodies whose rank 1 stays silent return each rank's time to its fault, None on rank 1: every
    other rank must have timed one."""
    assert [r for r, e in enumerate(times) if e is None] == [1], times


def peer_absent(spec: OpSpec, repeated: bool, T: float, case=None):
    """Rank 1 does not make a call within the timeout: on a shape's first call the others' agreement on shapes
    times out; on a repeated call (agreed before), their call's barrier does. Either names rank 1. Then reset() on
    every rank and two correct calls. ``case``: the call (default ``spec.faults.case``). Returns the time to the
    fault (None on rank 1)."""
    case = spec.faults.case if case is None else case
    with to.Context(timeout_s=T) as ctx:
        op = spec.new_op(ctx, case, "never")
        if repeated:
            correct(spec, op, ctx, case)
        call = spec.inputs(ctx, case, 0)
        # the ranks start the timed call together: a rank that started late would meet the first rank's relayed fault
        # sooner than its own timeout (on 2 loaded cores, ranks had drifted 0.2 s apart after the correct calls)
        ctx.barrier()
        ctx.check()
        out = None
        if ctx.rank != 1:
            msg, elapsed = timed(ctx, lambda: op(*call.args, **call.kwargs))
            want = "rank 1 to arrive at the call's barrier" if repeated else "rank 1 did not answer"
            assert want in msg and f"timeout_s={T:g}" in msg, msg
            assert in_time(msg, elapsed, T), (elapsed, msg)
            refused(spec, op, ctx, case, want)
            out = elapsed
        else:
            time.sleep(T + 0.5)  # absent for the whole timeout, then back for the reset
        ctx.reset()
        correct(spec, op, ctx, case, tag=1)
        correct(spec, op, ctx, case, tag=2)
        return out


def shapes_disagree(spec: OpSpec, how: str, T: float):
    """Ranks pass different shapes (the last rank more rows). ``how`` "first": on a shape's first call the agreement
    on shapes says so (ValueError on every rank, the Context stays usable); "repeated" (both shapes agreed before):
    the call's barrier finds the headers differ (ContextError on every rank, naming the op, both ranks and both
    shapes); "mixed" (rank 0 repeats a shape, the last rank brings a new one): both time out, each naming the
    other. A rank a call behind may learn of the mismatch at its check of the call before, from peers that went on
    (the fault is the Context's). Returns the time to the fault (None for "first")."""
    f = spec.faults
    small, large = f.rows(f.case, 8), f.rows(f.case, 12)
    with to.Context(timeout_s=T) as ctx:
        r, W = ctx.rank, ctx.world_size
        op = spec.new_op(ctx, f.case, "never")
        mine = large if r == W - 1 else small
        if how == "first":
            call = spec.inputs(ctx, mine, 0)
            with pytest.raises(ValueError, match="ranks disagree"):
                op(*call.args, **call.kwargs)
            correct(spec, op, ctx, small)  # still usable
            return None
        correct(spec, op, ctx, small)
        early = None
        try:
            correct(spec, op, ctx, large)
        except to.ContextError as e:
            if how != "repeated":
                raise
            # peers that went on to the next call met the mismatch before this rank checked this call: the
            # Context is faulted for every rank, and this rank's check() says so
            early = str(e)
        if how == "repeated":
            call = spec.inputs(ctx, mine, 0)
            msg, elapsed = (early, 0.0) if early else timed(ctx, lambda: op(*call.args, **call.kwargs))
            assert "ranks disagree on the call" in msg and spec.name in msg, msg
            assert f.header(small) in msg and f.header(large) in msg, msg  # both shapes
            assert elapsed <= SLACK_S, elapsed
        else:  # mixed
            call = spec.inputs(ctx, f.rows(f.case, 16) if r == W - 1 else small, 0)  # the last rank: never agreed
            ctx.barrier()  # the timed calls start together (see peer_absent)
            ctx.check()
            msg, elapsed = timed(ctx, lambda: op(*call.args, **call.kwargs))
            peers = [p for p in range(W) if p != r]
            assert any(re.search(rf"ranks? (\d+, )*{p}\b", msg) for p in peers), msg
            assert in_time(msg, elapsed, T), (elapsed, msg)
        with pytest.raises(to.ContextError, match="reset"):
            ctx.check()
        ctx.reset()
        correct(spec, op, ctx, small, tag=3)
        return elapsed


# ------------------------------------------------------------------------------------ the tests, per spec
def _named(fn, name: str, doc: str):
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


def _case_test(spec: OpSpec, name: str, cases: Cases, body, tol: Mapping, doc: str):
    @pytest.mark.parametrize("case", range(max(len(cases.host), len(cases.gpu))))
    def test(pool, case):
        mine = cases.on(pool)
        if case >= len(mine):
            pytest.skip("no such case for this backend")
        host_case_share(pool, case)
        worst = [max(errs.values()) if isinstance(errs, dict) else errs for errs in pool.run(body, spec, mine[case])]
        assert max(worst) < max(tol.values()), worst

    return _named(test, name, doc)


def _large_test(spec: OpSpec, key: str, case):
    def test(pool):
        if pool.backend == "host" and pool.world > 2:
            pytest.skip(f"{key} in the interpreter: run at W = 2 only to keep CI short")
        worst = pool.run(matches_reference, spec, case)
        assert max(worst) < max(spec.tol.values()), worst

    return _named(test, f"test_{spec.name}_{key}", f"{spec.name}: {case} (contract.matches_reference)")


def _variant_test(name: str, variants: Variants, body, why_not_host: str, calls, doc: str):
    if variants.ids:
        @pytest.mark.parametrize("variant", list(variants.ids))
        def test(pool, variant):
            pool.run(body, *calls(pool, variants.case(pool, variant, why_not_host)))  # the body asserts
    else:
        def test(pool):
            pool.run(body, *calls(pool, variants.case(pool, None, why_not_host)))
    return _named(test, name, doc)


def tests(spec: OpSpec) -> dict:
    """The contract's tests that apply to ``spec``, by name: ``globals().update(contract.tests(SPEC))``."""
    out = {}
    if spec.cases is not None:
        name = f"test_{spec.name}_matches_{spec.reference}"
        out[name] = _case_test(spec, name, spec.cases, matches_reference, spec.tol,
                               f"{spec.name}: each case against its reference (contract.matches_reference)")
    if spec.grad_cases is not None:
        name = f"test_{spec.name}_gradients_match_{spec.reference}"
        out[name] = _case_test(spec, name, spec.grad_cases, gradients_match, spec.grad_tol,
                               f"{spec.name}: gradients against float32 autograd (contract.gradients_match)")
    for key, case in spec.large_cases.items():
        out[f"test_{spec.name}_{key}"] = _large_test(spec, key, case)
    if spec.back_to_back is not None:
        b2b = spec.back_to_back
        name = f"test_{spec.name}_{b2b.calls}_back_to_back_calls"
        out[name] = _variant_test(name, b2b, back_to_back, "no back-to-back case on this backend",
                                  lambda pool, case: (spec, case, stress_rounds(pool, b2b.calls)),
                                  f"{spec.name}: calls back to back, no host synchronisation (contract.back_to_back)")
    if spec.bad_inputs is not None:
        def test(pool):
            assert all(pool.run(refuses_bad_input, spec))

        name = f"test_{spec.name}_bad_input_raises_before_launch"
        out[name] = _named(test, name, f"{spec.name}: bad input raises ValueError (contract.refuses_bad_input)")
    if spec.falls_back is not None:
        def test(pool):
            cases = spec.falls_back.on(pool)
            if not cases:
                pytest.skip("no small shape for this backend")
            assert all(pool.run(falls_back, spec, cases))

        name = f"test_{spec.name}_small_shapes_fall_back"
        out[name] = _named(test, name, f"{spec.name}: the fallback rule on small shapes (contract.falls_back)")
    if spec.replay is not None:
        rep = spec.replay
        name = f"test_{spec.name}_cuda_graph_replay"
        out[name] = _variant_test(name, rep, graph_replays, "CUDA graphs need a GPU",
                                  lambda pool, case: (spec, case, rep.calls, rep.warm),
                                  f"{spec.name}: CUDA-graph replays with new inputs (contract.graph_replays)")
    return out
