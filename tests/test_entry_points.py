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
