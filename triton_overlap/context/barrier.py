"""The device barrier among a host's ranks: its memory and its launch. The kernel is kernels.signal.barrier_kernel,
whose docstring says why it stays correct under CUDA-graph replay; docs/protocol.md has the rules."""
from __future__ import annotations

import torch

from ..kernels import signal as sig
from ..kernels.cached_launch import launch
from .errors import OWN_CALL, Call

#: the share of timeout_s a call's barrier waits for its peers (Context.barrier_budget)
BARRIER_SHARE = 0.9


class Barrier:
    """A slot per peer and a table of the peers' call headers (symmetric, made by ``symmetric(name, shape,
    dtype)``), and ``count``, the device int32 holding how many barriers this rank has passed."""

    def __init__(self, symmetric, rank: int, world: int, device: torch.device, clock: int):
        self.rank, self.world, self.device, self.clock = rank, world, device, clock
        self.slots = symmetric("__barrier", (world,), torch.int32)
        self.headers = symmetric("__headers", (2, world, sig.HEADER_WORDS), torch.int32)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.block = 1
        while self.block < world:
            self.block *= 2

    def build(self, budget: int) -> None:
        """Run the kernel once on scratch memory where every peer is this rank and has arrived (builds and loads
        it; the caller synchronises)."""
        W, dev = self.world, self.device
        slots = torch.full((W,), 1 << 30, dtype=torch.int32, device=dev)
        headers = torch.zeros(2 * W * sig.HEADER_WORDS, dtype=torch.int32, device=dev)
        err = torch.zeros(sig.ERR_WORDS, dtype=torch.int32, device=dev)
        launch(sig.barrier_kernel, (1,), (
            torch.full((W,), slots.data_ptr(), dtype=torch.int64, device=dev), slots,
            torch.zeros(1, dtype=torch.int32, device=dev), torch.full((W,), headers.data_ptr(), dtype=torch.int64,
                                                                     device=dev),
            headers, err, budget, self.rank, W, OWN_CALL.op, OWN_CALL.fingerprint, *OWN_CALL.dims),
            dict(BLOCK_W=self.block, CLOCK=self.clock))

    def launch(self, err: torch.Tensor, budget: int, call: Call) -> None:
        """Launch the barrier of ``call`` on the current stream; a wait that gives up writes into ``err``."""
        launch(sig.barrier_kernel, (1,), (
            self.slots.ptrs, self.slots.local, self.count, self.headers.ptrs, self.headers.local, err, budget,
            self.rank, self.world, call.op, call.fingerprint, *call.dims), dict(BLOCK_W=self.block, CLOCK=self.clock))
