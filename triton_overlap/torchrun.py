"""Process-group set-up for scripts started by torchrun, as ``scripts/launch.sh`` starts tutorials, benchmarks and
tuning: one process per GPU, or two processes on the host backend without GPUs."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def backend_name() -> str:
    """The Context backend the launcher chose ("host" without GPUs), else "auto"."""
    return os.environ.get("TRITON_OVERLAP_BACKEND", "auto")


def init(shared_gpu: bool = False) -> torch.device:
    """Initialise torch.distributed from torchrun's environment; returns this rank's device. Without that
    environment (a script run with plain ``python``) it exits with the command that runs it. ``shared_gpu``: every
    rank on GPU 0 over gloo (NCCL refuses two ranks on one GPU): a check of the protocol, never a timing."""
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT"
        raise SystemExit(f"{script} runs one process per rank: start it with the launcher, "
                         f"bash scripts/launch.sh {script} (torchrun's {', '.join(missing)} are not set)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if shared_gpu and torch.cuda.is_available():
        torch.cuda.set_device(0)
        dist.init_process_group("gloo")
        return torch.device("cuda", 0)
    if backend_name() != "host" and torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        return device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def say(*args) -> None:
    """Print from rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def verdict(ok: bool, detail: str = "") -> bool:
    """Gather every rank's ``ok``, print one PASS/FAIL line (rank 0), and return whether all passed."""
    oks = [None] * dist.get_world_size()
    dist.all_gather_object(oks, bool(ok))
    say(f"verdict: {'PASS' if all(oks) else 'FAIL'}{' — ' + detail if detail else ''} ({sum(oks)}/{len(oks)} ranks)")
    return all(oks)
