"""Every numbered tutorial, through the launcher, on the host backend: each must print a PASS verdict and exit
cleanly; and tutorial 05 (process-group traffic, the ops, autograd, a Context closed before the group is destroyed)
ten times over with no process aborting at exit."""
import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]_*.py")))
EXIT_ABORT = "terminate called"
EXIT_RUNS = 4  # dev/soak.py runs it 200 times


def _run(path):
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), path], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", TUTORIALS, ids=[os.path.basename(p) for p in TUTORIALS])
def test_tutorial_passes_on_host_backend(path):
    code, out = _run(path)
    assert code == 0 and EXIT_ABORT not in out, out[-4000:]
    assert "verdict: PASS" in out, out[-4000:]


def test_no_abort_at_exit():
    path = os.path.join(ROOT, "tutorials", "05_tensor_parallel_mlp.py")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: _run(path), range(EXIT_RUNS)))
    bad = [out[-2000:] for code, out in runs if code != 0 or EXIT_ABORT in out or "verdict: PASS" not in out]
    assert not bad, f"{len(bad)} of {EXIT_RUNS} runs failed or aborted at exit; the first:\n{bad[0]}"
