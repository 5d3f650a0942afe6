"""What a new user meets first: the launcher's help, a script run without the launcher, a GPU backend asked for
where there is none, the benchmark without GPUs. Each says what to do instead of failing obscurely."""
import os
import subprocess
import sys

import pytest
import torch

from harness import gpu_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, env=None, timeout=300):
    env = dict(os.environ, **(env or {}))
    env.pop("RANK", None)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_launcher_help():
    for flag in ("-h", "--help"):
        code, out = _run(["bash", "scripts/launch.sh", flag])
        assert code == 0 and "usage: bash scripts/launch.sh" in out, out
    code, out = _run(["bash", "scripts/launch.sh"])
    assert code == 2 and "usage" in out


def test_script_without_the_launcher_says_how_to_start_it():
    code, out = _run([sys.executable, "tutorials/01_context_and_signals.py"], env={"TRITON_INTERPRET": "1"})
    assert code != 0 and "bash scripts/launch.sh tutorials/01_context_and_signals.py" in out, out[-2000:]


@pytest.mark.skipif(gpu_count() > 0, reason="checks the machines without GPUs")
def test_benchmark_without_gpus_fails_and_says_why():
    code, out = _run([sys.executable, "benchmarks/bench.py", "ag_gemm"])
    assert code != 0 and "needs GPUs" in out, out[-2000:]


def _gpu_backend_without_gpu():
    import triton_overlap as to

    with pytest.raises(RuntimeError, match="needs a GPU"):
        to.Context(backend="cuda")
    return True


def test_gpu_backend_without_a_gpu_says_what_is_missing(pool):
    if pool.backend != "host" or torch.cuda.is_available():
        pytest.skip("checks the host backend's machines, which have no GPU")
    assert all(pool.run(_gpu_backend_without_gpu))


def test_auto_backend_follows_the_interpreter(monkeypatch):
    """backend="auto" is host wherever Triton interprets kernels, GPU or not (interpreted kernels cannot run on a GPU
    backend's streams); otherwise cuda where torch sees a GPU, host where it sees none."""
    from triton_overlap.context import backends

    for interprets, gpu, want in ((True, True, "host"), (True, False, "host"), (False, True, "cuda"),
                                  (False, False, "host")):
        monkeypatch.setattr(backends, "triton_interprets", lambda v=interprets: v)
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=gpu: v)
        monkeypatch.setattr(torch.version, "hip", None)
        assert backends.pick("auto") == want, (interprets, gpu)
        assert backends.pick("cuda") == "cuda"


def _misspelt_keywords():
    """A call's keywords must name fields of the op's config: a misspelt one raises TypeError naming it, also where
    the call would fall back to torch (fallback="auto" on small shapes, which never reads the config), and a bad
    value of a real one raises ValueError; both before any launch, and the Context works after them."""
    import triton_overlap as to

    with to.Context(timeout_s=30) as ctx:
        W, bf, dev = ctx.world_size, torch.bfloat16, ctx.device
        a, w = torch.randn(4 * W, 16, dtype=bf, device=dev), torch.randn(16, 8, dtype=bf, device=dev)
        x, we = torch.randn(4, 16, dtype=bf, device=dev), torch.randn(3, 16, 8, dtype=bf, device=dev)
        ids = torch.arange(4 * W * 2, device=dev).remainder(3).view(4 * W, 2)
        h, wd = torch.randn(4 * W, 2, 8, dtype=bf, device=dev), torch.randn(3, 8, 16, dtype=bf, device=dev)
        tw = torch.full((4 * W, 2), 0.5, device=dev)
        before = int(ctx.call_number.item())
        for name, call in (("return_gatherd", lambda: to.ag_gemm(a, w, ctx=ctx, return_gatherd=True)),
                           ("scatterr", lambda: to.gemm_rs(a, w, ctx=ctx, scatterr="copy")),
                           ("sortd_output", lambda: to.ag_moe_gemm(x, we, ids, ctx=ctx, sortd_output=True)),
                           ("blok_m", lambda: to.moe_gemm_rs(h, wd, ids, tw, ctx=ctx, blok_m=None))):
            with pytest.raises(TypeError, match=f"'{name}'.*fields of"):
                call()
        for field, call in (("block_m", lambda: to.AllGatherGEMM(ctx, fallback="never")(a, w, block_m=24)),
                            ("chunks_per_rank", lambda: to.gemm_rs(a, w, ctx=ctx, chunks_per_rank=0)),
                            ("num_streams", lambda: to.ag_moe_gemm(x, we, ids, ctx=ctx, num_streams=0))):
            with pytest.raises(ValueError, match=f"{field} must be"):
                call()
        assert int(ctx.call_number.item()) == before, "a refused call passed a barrier"
        assert to.ag_gemm(a, w, ctx=ctx).shape == (4 * W * W, 8)
        ctx.check()
    return True


def test_misspelt_keywords_raise_on_every_path(pool):
    assert all(pool.run(_misspelt_keywords))
