"""TPMoE, the tensor-parallel MoE layer: output and every gradient (input, router, experts) against the unsharded
plain module in float64, eager, under torch.autocast with float32 parameters, and compiled; empty experts; a shared
expert, gated and not; what it refuses.

The plain module (``PlainMoE``) keeps the experts as Mixtral and Qwen3-MoE do, nn.Linear's [out, in] per expert:
gate ``w1`` [E, hidden, dim], up ``w3`` [E, hidden, dim], down ``w2`` [E, dim, hidden], and a router
``nn.Linear(dim, E, bias=False)``; its parameters and input are rounded to bf16 so both start from the same values.
Tolerances (‖out − ref‖ / ‖ref‖) against float64: 2e-2 for the output (bf16 roundings of the gate/up rows, their
SwiGLU, each down product and each rank's partial: moe_gemm_rs's tolerance), 3e-2 for gradients (a bf16 block's,
tests/test_block.py). Measured on the host backend: 1.5e-2 for the output and gradients, about twice the fallback's
(Triton's interpreter rounds float32 to bf16 toward zero, GPUs to nearest)."""
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import triton_overlap as to
from triton_overlap.nn import TPMoE
from refs import check_grad_clipping, rel_err

TOL_OUT, TOL_GRAD = 2e-2, 3e-2


class PlainMoE(nn.Module):
    """The unsharded reference: softmax over ``E`` experts, top-``topk`` (``renormalize``: weights over the k
    choices summing to 1), SwiGLU experts ``down(silu(gate(x)) * up(x))``; rows [T, dim] in, [T, dim] out, in the
    parameters' dtype."""

    def __init__(self, dim, hidden, E, topk, renormalize, seed=0, shared=0, gated=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # the same on every rank
        r16 = lambda *shape, scale: (torch.randn(*shape, generator=g) * scale).bfloat16().float()  # noqa: E731
        self.topk, self.renormalize = topk, renormalize
        self.router = nn.Linear(dim, E, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(r16(E, dim, scale=dim ** -0.5))
        self.w1 = nn.Parameter(r16(E, hidden, dim, scale=dim ** -0.5))
        self.w3 = nn.Parameter(r16(E, hidden, dim, scale=dim ** -0.5))
        self.w2 = nn.Parameter(r16(E, dim, hidden, scale=hidden ** -0.5))
        self.shared = None  # a shared expert of width ``shared`` (its own MLP), its output gated where ``gated``
        if shared:
            self.shared = nn.ParameterList([nn.Parameter(r16(shared, dim, scale=dim ** -0.5)),
                                            nn.Parameter(r16(shared, dim, scale=dim ** -0.5)),
                                            nn.Parameter(r16(dim, shared, scale=shared ** -0.5))])
        self.shared_gate = nn.Linear(dim, 1, bias=False) if gated else None
        if gated:
            with torch.no_grad():
                self.shared_gate.weight.copy_(r16(1, dim, scale=dim ** -0.5))

    def routing(self, x):
        weights, ids = torch.softmax(self.router(x), dim=-1).topk(self.topk, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids

    def forward(self, x):
        weights, ids = self.routing(x)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, j = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                xe = x[tok]
                h = nn.functional.silu(xe @ self.w1[e].t()) * (xe @ self.w3[e].t())
                out = out.index_add(0, tok, weights[tok, j].unsqueeze(1) * (h @ self.w2[e].t()))
        if self.shared is not None:
            s1, s3, s2 = self.shared
            y = (nn.functional.silu(x @ s1.t()) * (x @ s3.t())) @ s2.t()
            out = out + (torch.sigmoid(self.shared_gate(x)) * y if self.shared_gate is not None else y)
        return out


def _sharded_grads(moe, ref, r):
    """The reference's gradients as rank r's shards of TPMoE's parameters (a shared expert's after the routed
    experts', its width cut into pieces of the experts' width)."""
    n, (w1, w3, w2) = moe.hidden_local, (ref.w1.grad, ref.w3.grad, ref.w2.grad)
    if ref.shared is not None:
        s1, s3, s2 = (p.grad for p in ref.shared)
        m, hidden, dim = s1.shape[0] // w1.shape[1], w1.shape[1], w1.shape[2]
        w1, w3 = torch.cat([w1, s1.reshape(m, hidden, dim)]), torch.cat([w3, s3.reshape(m, hidden, dim)])
        w2 = torch.cat([w2, torch.stack(s2.split(hidden, dim=1))])
    cols = slice(r * n, (r + 1) * n)
    grads = {"router": ref.router.weight.grad, "w13": torch.cat([w1[:, cols], w3[:, cols]], dim=1).transpose(1, 2),
             "w2": w2[:, :, cols].transpose(1, 2)}
    if ref.shared_gate is not None:
        grads["shared_gate"] = ref.shared_gate.weight.grad
    return grads


def _layer_case(S, B, dim, hidden, E, topk, renormalize, fallback, mode, expect_empty=False, shared=0, gated=False):
    """TPMoE against PlainMoE in float64 on every rank's S/W positions of [S, B, dim]. ``mode``: "bf16" (bf16
    parameters), "autocast" (float32 parameters under torch.autocast(bfloat16)), "compile" (bf16, compiled with
    fullgraph=True by inductor, against eager too), "frozen" (bf16, the experts' weights need no gradient: the
    backward skips their left operands), "frozen_input" (bf16, the input needs no gradient: no converse
    MoE-ReduceScatter); ``shared``, ``gated``: a shared expert of that width, gated.
    Returns the errors."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        plain = PlainMoE(dim, hidden, E, topk, renormalize, shared=shared, gated=gated)
        g = torch.Generator().manual_seed(3)
        x_full = torch.randn(S, B, dim, generator=g).bfloat16().double()
        gy = torch.randn(S, B, dim, generator=g)
        ref = PlainMoE(dim, hidden, E, topk, renormalize, shared=shared, gated=gated).double()
        ref.load_state_dict(plain.state_dict())
        x_ref = x_full.clone().requires_grad_()
        y_ref = ref(x_ref.reshape(-1, dim)).reshape(S, B, dim)
        (y_ref * gy.double()).sum().backward()
        ids = ref.routing(x_full.reshape(-1, dim))[1]
        empty = E - int(torch.unique(ids).numel())
        assert empty > 0 or not expect_empty, "the case was meant to leave experts without tokens"

        dtype = torch.float32 if mode == "autocast" else torch.bfloat16
        moe = TPMoE.from_full(plain.router, (plain.w1, plain.w3, plain.w2), ctx, topk=topk, renormalize=renormalize,
                              dtype=dtype, fallback=fallback, shared=plain.shared and tuple(plain.shared),
                              shared_gate=plain.shared_gate)
        assert moe.num_shared == shared // hidden
        if mode == "frozen":
            moe.w13.requires_grad_(False)
            moe.w2.requires_grad_(False)
        rows = slice(r * S // W, (r + 1) * S // W)
        gy_local = gy[rows].to(dev)

        saved = []  # the shapes autograd saves in eager runs (the gathered tokens [S * B, dim] for w13's gradient)

        def run(fn):
            moe.zero_grad(set_to_none=True)
            x = x_full[rows].to(dev, dtype).requires_grad_(mode != "frozen_input")
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "autocast"), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                y = fn(x)
            assert y.shape == (S // W, B, dim) and y.dtype == torch.bfloat16
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                (y.float() * gy_local).sum().backward()
            backward_ops.update(e.key for e in prof.key_averages() if e.key.startswith("triton_overlap::"))
            moe.sync_replicated_grads()
            got = {"out": y.detach(), "grad_x": x.grad, "router": moe.router.weight.grad, "w13": moe.w13.grad,
                   "w2": moe.w2.grad}
            return got if moe.shared_gate is None else {**got, "shared_gate": moe.shared_gate.weight.grad}

        backward_ops = set()
        got = run(moe)
        ctx.check()
        if mode in ("bf16", "frozen", "frozen_input") and fallback == "never":
            # frozen experts keep no gathered tokens; an input without a gradient has no converse MoE-RS
            assert ((S * B, dim) in saved) == (mode != "frozen"), (mode, saved)
            assert ("triton_overlap::moe_rs" in backward_ops) == (mode != "frozen_input"), (mode, backward_ops)
        want = {"out": y_ref[rows].detach(), "grad_x": x_ref.grad[rows], **_sharded_grads(moe, ref, r)}
        if mode == "frozen":
            assert got.pop("w13") is None and got.pop("w2") is None
            del want["w13"], want["w2"]
        if mode == "frozen_input":
            assert got.pop("grad_x") is None
            del want["grad_x"]
        errs = {k: rel_err(got[k], want[k]) for k in want}
        if mode == "autocast":
            assert all(got[k].dtype == torch.float32 for k in want if k != "out")
        if mode == "compile":
            compiled = run(torch.compile(moe, fullgraph=True))  # inductor; a graph break is an error
            ctx.check()
            errs.update({f"compiled.{k}": rel_err(compiled[k], want[k]) for k in want})
            errs.update({f"compiled_vs_eager.{k}": rel_err(compiled[k], got[k]) for k in want})
        bad = {k: v for k, v in errs.items() if v > (TOL_OUT if k.endswith("out") else TOL_GRAD)}
        assert not bad, f"rank {r}: {bad} (all: {errs})"
        if mode != "frozen":  # (frozen experts have no gradient here, the reference's do)
            gate = {} if moe.shared_gate is None else {"shared_gate": moe.shared_gate.weight.grad}
            check_grad_clipping(moe, ref, lambda: {k: rel_err(g, _sharded_grads(moe, ref, r)[k]) for k, g in {
                "router": moe.router.weight.grad, "w13": moe.w13.grad, "w2": moe.w2.grad, **gate}.items()}, TOL_GRAD)
        used = {type(op).__name__: op.last_path for op in moe.ops}
        return errs, used, empty


CASES = {  # S, B, dim, hidden, E, topk, renormalize, fallback, mode, expect_empty
    "bf16": (12, 2, 32, 48, 4, 2, True, "never", "bf16"),
    "fallback": (12, 2, 32, 48, 4, 2, False, "always", "bf16"),
    "empty_experts": (6, 2, 32, 48, 32, 2, True, "never", "bf16", True),  # 12 tokens x 2 < 32 experts
    "top1": (12, 1, 40, 24, 3, 1, False, "never", "bf16"),  # Switch Transformer's: the weight is the probability
    "autocast": (12, 2, 32, 48, 4, 2, True, "never", "autocast"),
    "frozen_experts": (12, 2, 32, 48, 4, 2, True, "never", "frozen"),
    "frozen_input": (12, 2, 32, 48, 4, 2, True, "never", "frozen_input"),
    "compile": (12, 2, 32, 48, 4, 2, True, "never", "compile"),
    # a shared expert twice the experts' width with Qwen2-MoE's sigmoid gate; one as wide, ungated (DeepSeek's)
    "shared_gated": (12, 2, 32, 48, 4, 2, False, "never", "bf16", False, 96, True),
    "shared_compile": (12, 2, 32, 48, 4, 2, True, "never", "compile", False, 48, False),
    "shared_fallback": (12, 2, 32, 48, 4, 2, True, "always", "autocast", False, 96, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tp_moe_matches_plain_module(pool, name):
    case = CASES[name]
    if pool.backend == "host" and pool.world == 3 and case[8] == "compile":
        pytest.skip("torch.compile on the host backend at W = 2: each rank compiles the layer (CI time)")
    if pool.backend != "host":  # GPU sizes: tiles of 128 rows and columns, every path of the kernels (the empty
        # experts' case keeps its few tokens: more would reach every expert)
        S, B, dim, hidden, E, topk, renorm, fallback, mode, empty, shared, gated = (
            *case, *(False, 0, False)[len(case) - 9:])
        case = (S * (1 if empty else 64), B, dim * 32, hidden * 32, E, topk, renorm, fallback, mode, empty,
                shared * 32, gated)
    results = pool.run(_layer_case, *case)
    want = "fallback" if case[7] == "always" else "overlap"
    assert all(set(used.values()) == {want} for _, used, _ in results), results


def expert_modules(plain):
    """``plain``'s experts as a list of modules with Qwen3-MoE's names (gate_proj, up_proj, down_proj)."""
    mods = nn.ModuleList()
    for e in range(plain.w1.shape[0]):
        m = nn.Module()
        for name, w in (("gate_proj", plain.w1[e]), ("up_proj", plain.w3[e]), ("down_proj", plain.w2[e])):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            setattr(m, name, lin)
        mods.append(m)
    return mods


def _refusals():
    with to.Context(timeout_s=30) as ctx:
        dev, W = ctx.device, ctx.world_size
        plain = PlainMoE(16, 8 * W, 4, 2, True)
        experts = (plain.w1, plain.w3, plain.w2)
        with pytest.raises(TypeError, match="fallbak"):
            TPMoE(16, 8 * W, 4, 2, ctx=ctx, fallbak="never")
        with pytest.raises(TypeError, match="renormalise"):
            TPMoE.from_full(plain.router, experts, ctx, topk=2, renormalise=True)
        if W > 1:
            with pytest.raises(ValueError, match="not divisible"):
                TPMoE(16, 8 * W + 1, 4, 2, ctx=ctx)
        with pytest.raises(ValueError, match="topk"):
            TPMoE(16, 8 * W, 4, 5, ctx=ctx)
        with pytest.raises(ValueError, match="experts must be"):
            TPMoE.from_full(plain.router, (plain.w1, plain.w1, plain.w2[:, :, :1]), ctx, topk=2)
        with pytest.raises(ValueError, match="shared expert's width 5 is not a multiple"):
            TPMoE.from_full(plain.router, experts, ctx, topk=2,
                            shared=(plain.w1[0, :5], plain.w3[0, :5], plain.w2[0, :, :5]))
        with pytest.raises(ValueError, match="shared_gate without a shared expert"):
            TPMoE.from_full(plain.router, experts, ctx, topk=2, shared_gate=nn.Linear(16, 1, bias=False))
        moe32 = TPMoE.from_full(plain.router, experts, ctx, topk=2, dtype=torch.float32)
        x = torch.randn(4, 16, device=dev)
        with pytest.raises(TypeError, match="bfloat16 or float16.*autocast"):
            moe32(x)
        moe = TPMoE.from_full(plain.router, experts, ctx, topk=2)
        with pytest.raises(TypeError, match="input is torch.float32"):
            moe(x)
        # the experts as modules (Qwen3-MoE's names) shard the same as stacked tensors
        again = TPMoE.from_full(plain.router, expert_modules(plain), ctx, topk=2)
        assert torch.equal(again.w13, moe.w13) and torch.equal(again.w2, moe.w2)
        # ranks with different numbers of tokens: ValueError on every rank before the routing's all-gather (over
        # gloo a gather of unequal sizes aborts the process), and the layer runs on after it
        with pytest.raises(ValueError, match=r"all_gather_rows .*ranks disagree.*rank 1: \(\(5,"):
            moe(torch.randn(4 + ctx.rank, 16, device=dev, dtype=torch.bfloat16))
        assert moe(torch.randn(4, 16, device=dev, dtype=torch.bfloat16)).shape == (4, 16)
        return True


def _no_tokens(fallback):
    """No rank has a token: an empty output, an empty input gradient and zero parameter gradients (as nn.Linear's on
    an empty batch), on either path."""
    with to.Context(timeout_s=30) as ctx:
        plain = PlainMoE(16, 8 * ctx.world_size, 4, 2, True)
        moe = TPMoE.from_full(plain.router, (plain.w1, plain.w3, plain.w2), ctx, topk=2, fallback=fallback)
        x = torch.empty(0, 16, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
        y = moe(x)
        y.sum().backward()
        assert y.shape == (0, 16) and x.grad.shape == (0, 16)
        assert all(p.grad is not None and not p.grad.any() for p in moe.parameters())
        return True


@pytest.mark.parametrize("fallback", ["never", "always"])
def test_tp_moe_without_tokens(pool, fallback):
    if pool.world != 2:
        pytest.skip("W = 2")
    assert all(pool.run(_no_tokens, fallback))


def test_tp_moe_refuses_what_it_cannot_run(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    assert all(pool.run(_refusals))


def _row_passes(shapes):
    """kernels.moe_rows through their custom ops, against torch on the same bf16 values: SwiGLU and its gradient
    within 1e-2 of float64 (one bf16 rounding: ~4e-3) and, on GPUs, no worse than torch's own bf16 SwiGLU plus 1e-3
    (Triton's interpreter rounds toward zero: 5e-3 there); the backward's row pass bit-equal to torch's float32
    products rounded once on GPUs (within one bf16 ulp in the interpreter), its dot within 1e-5. Outputs are new
    tensors, so rows a kernel skipped would show as the empty tensor's garbage, which the checks read. Also: the
    layers' SwiGLU takes the kernel for bf16, fp16 and float32 rows (column-major ones too) and torch for float64
    (exactly torch's), an odd width raises, and torch.library.opcheck passes on both ops."""
    from triton_overlap.nn.moe import SWIGLU
    from triton_overlap.ops import custom_ops

    out = []
    with to.Context(timeout_s=60) as ctx:
        g = torch.Generator(device=ctx.device).manual_seed(5)
        bound = 5e-3 if ctx.interpreted else None
        for R, n in shapes:
            h = torch.randn(R, 2 * n, device=ctx.device, generator=g).to(torch.bfloat16).requires_grad_()
            dy = torch.randn(R, n, device=ctx.device, generator=g).to(torch.bfloat16)
            y = custom_ops.swiglu(h)
            y.backward(dy)
            h64 = h.detach().double().requires_grad_()
            ref = nn.functional.silu(h64[:, :n]) * h64[:, n:]
            ref.backward(dy.double())
            hb = h.detach().clone().requires_grad_()
            theirs = nn.functional.silu(hb[:, :n]) * hb[:, n:]
            theirs.backward(dy)
            if R:
                for mine, torch_own, want in ((y, theirs, ref), (h.grad, hb.grad, h64.grad)):
                    limit = bound or min(1e-2, rel_err(torch_own, want) + 1e-3)
                    assert rel_err(mine, want) < limit, (R, n, rel_err(mine, want), limit)
            assert y.shape == (R, n) and h.grad.shape == (R, 2 * n)
            rows = torch.randn(R + 5, n, device=ctx.device, generator=g).to(torch.bfloat16)
            src = torch.randperm(R + 5, device=ctx.device, generator=g)[:R].to(torch.int32)
            scale = torch.rand(R, device=ctx.device, generator=g)
            a = h.detach()[:, :n].contiguous()
            grad_a, a_scaled, dots = custom_ops.moe_row_grads(rows, src, scale, a)
            picked = rows[src.long()].float()
            want = [(picked * scale[:, None]).to(a.dtype), (a.float() * scale[:, None]).to(a.dtype)]
            for got, ref_t in zip((grad_a, a_scaled), want):
                if ctx.interpreted:
                    assert (got.float() - ref_t.float()).abs().le(ref_t.float().abs() * 2 ** -7).all(), (R, n)
                else:
                    assert torch.equal(got, ref_t), (R, n)
            assert torch.allclose(dots, (picked * a.float()).sum(1), rtol=1e-5, atol=1e-5), (R, n)
            unscaled = custom_ops.moe_row_grads(rows, src, scale, a, False)  # (no weight gradient wanted)
            assert unscaled[1].shape == (0, n) and torch.equal(unscaled[0], grad_a) and torch.equal(unscaled[2], dots)
            out.append(True)
        x = torch.randn(64, 24, device=ctx.device, generator=g, dtype=torch.float64)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for t in (x.to(dtype), x.to(dtype).t().contiguous().t()):  # (rows, and a column-major copy)
                t = t.detach().requires_grad_()
                y = SWIGLU(t)
                assert "swiglu" in type(y.grad_fn).__name__.lower(), (dtype, type(y.grad_fn).__name__)
                y.sum().backward()
                assert rel_err(y, nn.functional.silu(x[:, :12]) * x[:, 12:]) < 1e-2, dtype
        x64 = x.detach().requires_grad_()
        assert torch.equal(SWIGLU(x64), nn.functional.silu(x[:, :12]) * x[:, 12:])  # float64: torch's, exactly
        with pytest.raises(ValueError, match="odd width"):
            custom_ops.swiglu(x[:, :7].to(torch.bfloat16))
        small = torch.randn(5, 6, device=ctx.device, generator=g).to(torch.bfloat16)
        torch.library.opcheck(custom_ops.swiglu, (small.requires_grad_(),))
        src = torch.tensor([2, 0, 1], dtype=torch.int32, device=ctx.device)
        torch.library.opcheck(custom_ops.moe_row_grads, (small.detach()[:4, :5], src, torch.rand(
            3, device=ctx.device, generator=g), small.detach().t()[:3]))  # (h [3, 5] column-major)
        torch.library.opcheck(custom_ops.moe_row_grads, (small.detach()[:4, :5], src, torch.rand(
            3, device=ctx.device, generator=g), small.detach()[:3, :5], False))
        with pytest.raises(ValueError, match="do not fit"):
            custom_ops.moe_row_grads(small.detach(), src, torch.rand(3, device=ctx.device), small.detach()[:3, :5])
    return all(out)


def test_moe_row_passes(pool):
    """SwiGLU and the MoE-RS backward's row pass (kernels.moe_rows) at odd sizes, one row and none."""
    if pool.world != 2:
        pytest.skip("W = 2 (each rank checks alone)")
    assert all(pool.run(_row_passes, [(37, 19), (130, 333), (1, 8), (0, 16)]))
