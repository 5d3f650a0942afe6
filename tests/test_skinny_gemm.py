"""Decode's local product (kernels.skinny_gemm, nn.local_linear) against a float64 torch reference: in Triton's
interpreter on the CPU (float16: the interpreter's bfloat16 dot is not exact) and, where a GPU is present, bfloat16
on it, with poisoned outputs, odd column counts and row counts from 1 to MAX_ROWS; and its rule."""
import torch

from triton_overlap.kernels import skinny_gemm as sg
from triton_overlap.nn import local_linear

# relative to the largest |reference| value: float32 sums of 16-bit products, one rounding to the output dtype
TOL = 1e-2


def _reference(x, w, bias):
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


def _check(y, ref):
    assert torch.isfinite(y).all(), "the poisoned output was not overwritten everywhere"
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL, f"relative error {err:.2e} above {TOL}"


#: (rows, columns, K, bias): in the interpreter (small, odd column counts) and on a GPU (past the rule's minimum)
HOST_CASES = [(1, 200, 512, False), (3, 130, 256, True), (16, 64, 768, True), (7, 257, 256, False)]
#: (rows, columns, K, bias, padded): ``padded`` rows of x and of out strided past their ends (views of wider tensors)
GPU_CASES = [(1, sg.MIN_N + 96, sg.MIN_K + 2 * sg.BLOCK_K, False, False), (5, sg.MIN_N, sg.MAX_N // 2, True, True),
             (16, sg.MAX_N, sg.MIN_K, True, False)]


def _matches_reference():
    """On this pool rank's device (the host backend: Triton's interpreter, float16; a GPU: bfloat16, and the
    layer's entry ``local_linear`` taking the kernel, bit for bit): every case against the float64 reference.
    Returns the cases checked."""
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dt = torch.bfloat16 if gpu else torch.float16
    cases = GPU_CASES if gpu else [case + (False,) for case in HOST_CASES]
    for M, N, K, bias, padded in cases:
        g = torch.Generator().manual_seed(M * N)
        pad = 64 if padded else 0
        x = torch.randn(M, K + pad, generator=g).to(dev, dt)[:, :K]
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dev, dt)
        b = torch.randn(N, generator=g).to(dev, dt) if bias else None
        out = torch.full((M, N + pad), float("nan"), device=dev, dtype=dt)[:, :N]
        assert sg.skinny_linear(x, w, b, out=out) is out
        _check(out, _reference(x, w, b))
        if gpu:
            assert sg.usable(x, w, b)
            with torch.no_grad():
                y = local_linear(x.unsqueeze(1), w, b)
            assert torch.equal(y.view(M, N), out)
    return len(cases)


def test_skinny_gemm_matches_reference(pool):
    assert all(n > 0 for n in pool.run(_matches_reference))


def test_rule():
    w = torch.empty(sg.MIN_N, sg.MIN_K, dtype=torch.bfloat16)
    x = torch.empty(4, sg.MIN_K, dtype=torch.bfloat16)
    assert sg.fits(x, w) and sg.fits(x, w, torch.empty(sg.MIN_N, dtype=torch.bfloat16))
    assert not sg.usable(x, w)  # a CPU tensor: F.linear
    assert sg.fits(x[:1], w) and not sg.fits(torch.empty(sg.MAX_ROWS + 1, sg.MIN_K, dtype=torch.bfloat16), w)
    assert not sg.fits(x.float(), w.float())  # 16-bit only
    assert not sg.fits(x, w.half())  # one dtype
    wide = torch.empty(4, sg.MIN_K + 256, dtype=torch.bfloat16)
    assert not sg.fits(wide[:, :sg.MIN_K + 128], torch.empty(sg.MIN_N, sg.MIN_K + 128, dtype=torch.bfloat16))  # steps
    assert sg.fits(wide[:, 8:sg.MIN_K + 8], w) and not sg.fits(wide[:, 4:sg.MIN_K + 4], w)  # rows 16-byte aligned
    assert not sg.fits(torch.empty(4, sg.MIN_K + 4, dtype=torch.bfloat16)[:, :sg.MIN_K], w)  # row stride
    assert not sg.fits(x, w, torch.empty(sg.MIN_N - 1, dtype=torch.bfloat16))  # a bias of N values
    assert not sg.fits(x, w[: sg.MIN_N - 64])  # a small weight: cuBLAS
    assert not sg.fits(x, torch.empty(sg.MAX_N + 64, sg.MIN_K, dtype=torch.bfloat16))  # a wide one too
    assert not sg.fits(x, w.t().contiguous().t())  # the weight's rows not contiguous along K
    assert not sg.fits(x, w, torch.empty(sg.MIN_N, dtype=torch.float32))


def test_local_linear_routes(monkeypatch):
    """nn.local_linear takes the kernel where its rule holds and there is no autograd to record, else F.linear (a
    stand-in kernel marks which ran)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    ref = torch.nn.functional.linear(x, w)
    calls = []
    monkeypatch.setattr(sg, "usable", lambda *args: True)
    monkeypatch.setattr(sg, "skinny_linear", lambda rows, w, b: calls.append(rows.shape) or rows @ w.t())
    y = local_linear(x, w)
    assert not calls and y.grad_fn is not None  # autograd: F.linear
    with torch.no_grad():
        y = local_linear(x, w)
    assert calls == [(6, 64)] and y.shape == (2, 3, 32)
    torch.testing.assert_close(y, ref.detach())
    monkeypatch.setattr(sg, "usable", lambda *args: False)
    with torch.no_grad():
        local_linear(x, w)
    assert len(calls) == 1  # outside the rule: F.linear
