"""What exchanges between hosts travel on (producers.link), and the store's way of making them.

A Context whose group spans hosts of equal size makes a ``Wire`` when it is set up and again at every reset, while
every rank is known to be present: over NCCL the wire is a communicator of its own, which every rank must join at
once, and which a fault ends (``end``) so that exchanges still open on it drain.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Wire:
    """What exchanges between hosts travel on: the process ``group`` (its NCCL point-to-point on GPUs, with
    ``global_ranks`` its ranks' global numbers) and the ranks' key-value ``store`` (elsewhere: the host backend, and
    several ranks sharing one GPU over gloo, whose point-to-point closes its connection on a timeout). ``rank``:
    this rank in the group."""
    group: object
    store: object
    rank: int
    global_ranks: tuple
    timeout_s: float
    nccl: bool
    #: the store keys of this rank's last WIRE_KEPT sends: a receive that gave up leaves its sender's keys behind
    #: (``drop_left``)
    sent: deque = field(default_factory=lambda: deque(maxlen=WIRE_KEPT), compare=False, repr=False)


#: the largest value wire_exchange puts in the store at once (torch's TCPStore takes 8 MiB)
WIRE_PIECE = 4 << 20
#: how many sends a wire remembers for ``drop_left``: a faulted Context refuses calls, so only the sends of the calls
#: in flight at the fault can be left (a call makes a few exchanges per chunk)
WIRE_KEPT = 256


def wire_exchange(wire: Wire, sends, recvs, tag: int, what: str, on_timeout=None) -> None:
    """``sends`` and ``recvs`` ((CPU tensor, group rank) lists) through the store: each send is a key of its own,
    each receive waits for its key (at most the wire's timeout in all) and deletes it. Receives may be strided views.
    On a timeout, ``on_timeout(late group ranks, elapsed s)`` (which may raise an error of its own), else
    TimeoutError naming ``what`` and those ranks."""
    import datetime
    import time

    def keys(src, dst, i, nbytes):  # a value in pieces: the store takes values of a few MiB at most
        return [f"wire/{tag}/{src}-{dst}/{i}/{p}" for p in range(max(1, -(-nbytes // WIRE_PIECE)))]

    sent: dict = {}
    for t, peer in sends:
        i = sent[peer] = sent.get(peer, -1) + 1
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        ks = keys(wire.rank, peer, i, len(data))
        wire.sent.append(ks)
        for p, k in enumerate(ks):
            wire.store.set(k, data[p * WIRE_PIECE:(p + 1) * WIRE_PIECE])
    late, got, t0 = [], {}, time.monotonic()
    for t, peer in recvs:
        i = got[peer] = got.get(peer, -1) + 1
        nbytes = t.numel() * t.element_size()
        ks = keys(peer, wire.rank, i, nbytes)
        try:
            wire.store.wait(ks, datetime.timedelta(seconds=max(0.001, wire.timeout_s - (time.monotonic() - t0))))
        except RuntimeError:  # (torch's DistStoreError is one)
            late.append(peer)
            continue
        data = b"".join(wire.store.get(k) for k in ks)
        for k in ks:
            wire.store.delete_key(k)
        if len(data) != nbytes:  # (the call headers' comparison comes first: a backstop)
            raise RuntimeError(f"{what}: rank {peer} sent {len(data)} bytes where {nbytes} were expected")
        t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype).view(t.shape))
    if late:
        late = sorted(set(late))
        if on_timeout is not None:
            on_timeout(late, time.monotonic() - t0)
        raise TimeoutError(f"{what}: no answer in {wire.timeout_s:g} s from ranks {late}")


def drop_left(wire: Wire | None) -> None:
    """Delete from the store what this rank's sends left there (a receiver that gave up never took it), which
    would otherwise stay as long as the store. Only once every rank's work has ended (reset's and close's
    barriers), so that no receive still waits for it."""
    if wire is None:
        return
    while wire.sent:
        for k in wire.sent.popleft():
            wire.store.delete_key(k)


def open_wire(group, rank: int, topology, device: torch.device, store, timeout_s: float) -> Wire | None:
    """The wire of a Context on ``group`` (collective over NCCL: every rank calls it at once); None on one host
    and on hosts of different sizes, which take no path between them."""
    if topology.num_hosts == 1 or not topology.uniform:
        return None
    ranks = tuple(_global_rank(group, p) for p in range(dist.get_world_size(group)))
    nccl = device.type == "cuda" and dist.get_backend(group) == "nccl"
    own = dist.new_group(list(ranks), backend="nccl", use_local_synchronization=True) if nccl else None
    if own is not None:
        # start the communicator now, while every rank is here: NCCL makes it at its first operation (the
        # exchanges' batched point-to-point uses the group's communicator, as a collective does), and a first
        # exchange whose peer never came would block this host in NCCL's set-up, where no timeout reaches
        dist.all_reduce(torch.zeros(1, device=device), group=own)
    return Wire(own or group, store, rank, ranks, timeout_s, nccl)


def end(wire: Wire) -> bool:
    """End ``wire``'s communicator of its own (over NCCL; nothing otherwise): exchanges still open on it end.
    Returns whether it ended within the wire's ``timeout_s``. NCCL (2.26 and later) ends a communicator only once
    every CUDA graph that captured its operations is destroyed, so a caller's graph that still holds a call across
    hosts keeps it from ending: the ending then goes on in a thread of its own, and the Context says so (HELD_WIRE)."""
    if not wire.nccl:
        return True
    done = threading.Event()

    def abort():
        try:
            dist.distributed_c10d._abort_process_group(wire.group)
        except Exception:  # noqa: BLE001 - already gone (destroyed with the default group)
            pass
        finally:
            done.set()

    threading.Thread(target=abort, name="triton_overlap wire end", daemon=True).start()
    return done.wait(wire.timeout_s)


#: what a Context says where its wire's communicator did not end in time (``end``)
HELD_WIRE = ("rank {}: the communicator between hosts did not end within timeout_s={:g} s: NCCL (2.26 and "
             "later) ends a communicator only once every CUDA graph that captured its operations is destroyed; "
             "destroy the graphs that captured calls across hosts before reset() or close() (docs/hosts.md)")


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)
