"""Every numbered tutorial, through the launcher, on the host backend: each must print a PASS verdict and exit
cleanly, no process aborting at exit ("terminate called"; dev/soak.py runs tutorial 05 200 times for that)."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "[0-9][0-9]_*.py")))
EXIT_ABORT = "terminate called"


def _run(path):
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host")
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), path], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", TUTORIALS, ids=[os.path.basename(p) for p in TUTORIALS])
def test_tutorial_passes_on_host_backend(path):
    code, out = _run(path)
    assert code == 0 and EXIT_ABORT not in out, out[-4000:]
    if "verdict: SKIP" in out:  # a tutorial whose optional dependency is not installed says so
        pytest.skip(out[out.index("verdict: SKIP"):].splitlines()[0])
    assert "verdict: PASS" in out, out[-4000:]
