"""The Gluon kernels, which only run on a Hopper GPU, compile for sm_90 with this Triton without a GPU: front end,
LLVM and the ptxas Triton ships (dev/compile_check.py, one configuration each: the warp-specialized GEMM-RS GEMM,
the AllGather GEMM, the attention forward at its shipped blocks, the attention backward with its query heads
split, the MoE ops' grouped GEMMs). What runs them is the GPU suite; this catches a Triton whose Gluon API or code
generation no longer takes them."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile_check():
    pytest.importorskip("triton.experimental.gluon")
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    spec = importlib.util.spec_from_file_location("compile_check", os.path.join(ROOT, "dev", "compile_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel", ["compile_warp_specialized", "compile_gather_hopper", "compile_attention_ws",
                                    "compile_attention_bwd_ws", "compile_grouped_hopper"])
def test_gluon_kernel_compiles_for_hopper(kernel, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # its own cache: compiled here, whatever else runs
    cc = _compile_check()
    from triton.backends.compiler import GPUTarget

    failed = getattr(cc, kernel)(GPUTarget("cuda", 90, 32), quick=True)
    report = capsys.readouterr().out
    assert failed == 0, report
    # ptxas ran on the kernel and said how many registers it takes (the figures the check exists to print)
    assert re.search(r": regs \d+, spill stores \d+.*, shared \d+ B", report), report
