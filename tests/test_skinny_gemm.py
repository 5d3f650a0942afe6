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
GPU_CASES = [(M, sg.MIN_N + 96, sg.MIN_K + 2 * sg.BLOCK_K, bias) for M, bias in ((1, False), (5, True), (16, True))]


def _matches_reference():
    """On this pool rank's device (the host backend: Triton's interpreter, float16; a GPU: bfloat16, and the
    layer's entry ``local_linear`` taking the kernel, bit for bit): every case against the float64 reference.
    Returns the cases checked."""
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dt = torch.bfloat16 if gpu else torch.float16
    cases = GPU_CASES if gpu else HOST_CASES
    for M, N, K, bias in cases:
        g = torch.Generator().manual_seed(M * N)
        x = torch.randn(M, K, generator=g).to(dev, dt)
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dev, dt)
        b = torch.randn(N, generator=g).to(dev, dt) if bias else None
        out = torch.full((M, N), float("nan"), device=dev, dtype=dt)
        assert sg.skinny_linear(x, w, b, out=out) is out
        _check(out, _reference(x, w, b))
        if gpu:
            assert sg.usable(x, w, b)
            with torch.no_grad():
                y = local_linear(x.view(M, 1, K), w, b)
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
    assert not sg.fits(x[:, :-8], w[:, :-8])  # K a whole number of steps
    assert not sg.fits(x, w[: sg.MIN_N - 64])  # a small weight: cuBLAS
    assert not sg.fits(x, torch.empty(sg.MAX_N + 64, sg.MIN_K, dtype=torch.bfloat16))  # a wide one too
    assert not sg.fits(x, w.t().contiguous().t())  # the weight's rows not contiguous along K
    assert not sg.fits(x, w, torch.empty(sg.MIN_N, dtype=torch.float32))


def test_local_linear_keeps_autograd_and_cpu_on_torch():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = local_linear(x, w)
    assert y.shape == (2, 3, 32) and y.grad_fn is not None
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
