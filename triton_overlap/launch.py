"""Process-group set-up for scripts started by scripts/launch.sh (torchrun)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def backend_name() -> str:
    """The Context backend the launcher chose ("host" without GPUs), else "auto"."""
    return os.environ.get("TRITON_OVERLAP_BACKEND", "auto")


def init() -> torch.device:
    """Initialise torch.distributed from torchrun's environment; returns this rank's device."""
    if dist.is_initialized():
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
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
