"""Which ranks of a group share a host.

A Context maps every peer's memory into its own (CUDA or HIP IPC, shared files on the host backend), which only
works between processes of one host. Ranks are placed on hosts by their hostname and boot id, exchanged once when
a Context is made. ``TRITON_OVERLAP_VIRTUAL_HOSTS=N`` instead splits the default group's ranks into N contiguous
blocks and treats each block as a host of its own (for tests: several hosts' behaviour on one machine).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

VIRTUAL_HOSTS_ENV = "TRITON_OVERLAP_VIRTUAL_HOSTS"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def virtual_hosts(world: int) -> int | None:
    """The number of virtual hosts asked for by TRITON_OVERLAP_VIRTUAL_HOSTS over a default group of ``world``
    ranks, or None when it is not set. ValueError for a value that is not a whole number from 1 to ``world``."""
    raw = os.environ.get(VIRTUAL_HOSTS_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= world:
        raise ValueError(f"{VIRTUAL_HOSTS_ENV}={raw!r}: want a whole number of hosts from 1 to the default group's "
                         f"{world} ranks")
    return n


def host_key(global_rank: int, global_world: int) -> str:
    """What this process says about its host: its hostname and boot id, or its block under virtual hosts."""
    n = virtual_hosts(global_world)
    if n is not None:
        return f"virtual host {global_rank * n // global_world}"
    return f"{socket.gethostname()} ({_boot_id()[:8] or 'no boot id'})"


@dataclass(frozen=True)
class Topology:
    """The hosts of a group: ``hosts[h]`` lists the group ranks on host ``h`` (hosts in order of their lowest
    rank), ``names[h]`` what those ranks said about it."""

    hosts: tuple
    names: tuple

    @classmethod
    def from_keys(cls, keys: list) -> "Topology":
        """From every group rank's host key (``host_key``), in group-rank order."""
        order: dict[str, list[int]] = {}
        for r, k in enumerate(keys):
            order.setdefault(k, []).append(r)
        return cls(tuple(tuple(v) for v in order.values()), tuple(order))

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def uniform(self) -> bool:
        """Whether every host has the same number of ranks (the path between hosts pairs each rank with the ranks
        at its local index on the other hosts)."""
        return len({len(r) for r in self.hosts}) == 1

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def local_ranks(self, rank: int) -> list[int]:
        """The group ranks on ``rank``'s host, ``rank`` included."""
        return list(self.hosts[self.host_of(rank)])

    def remote_ranks(self, rank: int) -> tuple[int, ...]:
        """The group ranks on the other hosts than ``rank``'s, in rank order."""
        mine = set(self.local_ranks(rank))
        return tuple(sorted(p for ranks in self.hosts for p in ranks if p not in mine))

    def describe(self) -> str:
        def span(ranks):
            return f"rank {ranks[0]}" if len(ranks) == 1 else (
                f"ranks {ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1))
                else "ranks " + ", ".join(map(str, ranks)))
        return "; ".join(f"{span(r)} on {n}" for r, n in zip(self.hosts, self.names))
