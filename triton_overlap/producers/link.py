"""Between hosts: the process group's point-to-point (NCCL on GPUs) on a producer stream, raising the same per-chunk
flags as the copy engines do within a host, so the consumers wait exactly as they do on one host.

Ranks are placed as ``(host, local index)``. Every host has the same number of ranks, and rank ``(h, i)``'s
counterparts are the ranks ``(h', i)`` of the other hosts. A gather moves each shard across hosts once per host,
between counterparts, and the receiving rank forwards it to its own host's peers by copy engine (a link between
hosts carries ``1 / L`` of what a direct exchange with every remote rank would, for L ranks per host). Partial
outputs (GEMM-ReduceScatter, attention's dK/dV) go straight from each rank to each owner on another host.

Each call's first exchange between hosts carries the ranks' call headers (call number, op, fingerprint, sizes), and
a kernel compares them on the device (kernels.signal.remote_header_kernel) before any of the peer's chunks is
flagged ready: the barrier compares headers within a host only. Where exchanges block the host (not NCCL), a
difference is raised before any data moves; over NCCL every wait of the call gives up and the Context reports it,
while the exchanges of differing sizes are NCCL's to fail (a receive never writes past the size its rank posted).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..context.backend import Wire
from ..kernels import signal as sig
from ..kernels.cached_launch import launch

#: the process group's point-to-point tags start here (clear of small tags a user's own exchanges may use)
TAG_BASE = 1 << 20


class Link:
    """The Context's point-to-point between hosts (made once per Context, and again after ``reset()``).

    ``counterparts``: the ranks at this rank's local index on the other hosts; ``remote``: every rank on another
    host. Every rank makes the same exchanges in the same order, so each exchange's tag (``next_tag``) matches its
    peer's; a tag also carries the Context's reset count, so that a receive left over from before a fault never
    matches a later send.
    """

    def __init__(self, ctx):
        self.ctx = ctx
        topo, r = ctx.topology, ctx.rank
        host = topo.host_of(r)
        index = topo.hosts[host].index(r)
        self.counterparts = [ranks[index] for h, ranks in enumerate(topo.hosts) if h != host]
        self.remote = [p for p in range(ctx.world_size) if p not in set(topo.hosts[host])]
        self.wire = Wire(ctx.group, ctx.store, r, tuple(_global_rank(ctx.group, p) for p in range(ctx.world_size)),
                         ctx.timeout_s, ctx.device.type == "cuda" and dist.get_backend(ctx.group) == "nccl")
        self._epoch = ctx.resets % 64
        self._seq = 0
        self._headers = torch.zeros((ctx.world_size, sig.HEADER_WORDS), dtype=torch.int32, device=ctx.device)
        self._mine: dict = {}  # call -> this rank's header to send (its call number filled in on the stream)

    def next_tag(self) -> int:
        self._seq += 1
        return TAG_BASE + ((self._epoch << 24) | (self._seq & 0xFFFFFF)) % ((1 << 31) - TAG_BASE)

    def exchange(self, stream, sends, recvs, what: str, op: int, waits: dict) -> None:
        """``sends`` and ``recvs``: (tensor, group rank) lists, through ``stream`` (Stream.exchange). ``op`` and
        ``waits`` (group rank -> the chunk, or a WHAT_* code, waited for from that rank) describe a peer that does
        not answer within the timeout: the Context is faulted as a kernel's wait would fault it."""
        ctx = self.ctx

        def timed_out(late, elapsed):
            peer = late[0]
            what_code = waits.get(peer, int(sig.WHAT_ANSWER))
            raise ctx.record_timeout(op, peer, what_code, elapsed, self._call_number(stream))

        stream.exchange(self.wire, sends, recvs, self.next_tag(), f"rank {ctx.rank}: {what}", timed_out)

    def _call_number(self, stream) -> int:
        """The number of the call in progress (read after this stream's work, which includes the call's barrier)."""
        number = self.ctx.call_number
        if number.device.type == "cpu":
            return int(number)
        with torch.cuda.stream(stream.torch_stream):  # not the caller's stream: a consumer may spin there
            return int(number.to("cpu"))

    def check_call(self, stream, call, peers) -> None:
        """On ``stream``, after the call's barrier: send this rank's header to ``peers`` (on other hosts), receive
        theirs and compare them with this call; a difference faults the Context on the device (ERR_MISMATCH), so
        every wait of the call gives up."""
        ctx = self.ctx
        mine = self._mine.get(call)
        if mine is None:
            words = [0, call.op, call.fingerprint, *call.dims, 0]
            mine = self._mine[call] = torch.tensor(words, dtype=torch.int32, device=ctx.device)
        stream.copy(mine[:1], ctx.call_number)
        self.exchange(stream, [(mine, p) for p in peers], [(self._headers[p], p) for p in peers],
                      f"{ctx.op_name(call.op)} call headers", call.op, {p: int(sig.WHAT_ARRIVAL) for p in peers})
        with ctx.use_stream(stream):
            for p in peers:
                launch(sig.remote_header_kernel, (1,), (self._headers[p], ctx.call_number, ctx.err, ctx.rank, p,
                                                        call.op, call.fingerprint), {})
        ctx.after_launch()  # (the host backend raises a difference here)
        if ctx.device.type == "cuda" and not self.wire.nccl:  # exchanges block the host here: see it before them
            with torch.cuda.stream(stream.torch_stream):
                failed = int(ctx.err[0].item()) != 0
            if failed:
                ctx.check()


def open_call(ctx, stream, call) -> None:
    """A call's opening on ``stream`` (every producer's): the barrier among this host's ranks and, on a group that
    spans hosts, the comparison of call headers with the ranks at this rank's local index on the other hosts (a
    difference anywhere reaches every rank through its host's barrier or its counterparts)."""
    ctx.barrier(stream, call)
    if ctx.num_hosts > 1:
        ln = link(ctx)
        ln.check_call(stream, call, ln.counterparts)


def link(ctx) -> Link:
    """The Context's Link (kept by the Context)."""
    return ctx.cached("link", lambda: Link(ctx))


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)
