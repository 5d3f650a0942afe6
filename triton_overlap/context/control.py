"""The Context's host-side exchanges, each bounded by a timeout and naming the ranks that did not answer.

A process group's own collectives wait as long as the group's timeout (minutes, by default), and a missing rank
shows as a hang or as an error that does not say which rank is missing. The Context's host-side steps (agreeing
on shapes, exchanging memory handles, the barriers of set-up, growth, reset and close) go instead through the key-
value store the process group was set up with: every rank writes its part under a key of its own and reads every
peer's, waiting at most the Context's timeout, so a rank that never writes is named.
"""
from __future__ import annotations

import itertools
import pickle
import time
from datetime import timedelta

import torch.distributed as dist

_contexts = itertools.count()  # Contexts made in this process: every rank makes them in the same order


class PeerTimeout(RuntimeError):
    """Ranks did not answer a host-side exchange in time. ``missing``: their ranks in the group."""

    def __init__(self, msg: str, missing: list[int]):
        super().__init__(msg)
        self.missing = missing


def _default_store():
    """The key-value store torch.distributed was initialised with (torch keeps it with the default group)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class ControlPlane:
    """Bounded host-side exchanges among the ranks of ``group``.

    ``exchange(obj, what)``: every rank's ``obj``, in group-rank order. Keys carry an epoch (bumped by
    ``resync``) and a sequence number, so a late rank's writes from before a fault never satisfy a later exchange.
    """

    def __init__(self, group, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        name = getattr(group, "group_name", None) or "world"
        self._prefix = f"triton_overlap/{name}/{next(_contexts)}"
        self._store = dist.PrefixStore(self._prefix, _default_store())
        self._epoch = 0
        self._seq = 0
        self._mine: list[str] = []  # our keys still in the store

    def _key(self, tag: str, rank: int) -> str:
        return f"{tag}/{rank}"

    def exchange(self, obj, what: str, tag: str | None = None) -> list:
        """Every rank's ``obj`` (a collective), waiting at most ``timeout_s``; PeerTimeout names the ranks whose
        part did not come. ``tag``: a key of its own (reset and close use fixed ones), else the next in sequence."""
        if tag is None:
            tag = f"e{self._epoch}/x{self._seq}"
            self._seq += 1
        store = self._store
        store.set(self._key(tag, self.rank), pickle.dumps(obj))
        keys = [self._key(tag, r) for r in range(self.world)]
        start = time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store's timeout error names no rank: find the ranks that did not come
            missing = [r for r in range(self.world) if not store.check([keys[r]])]
            if not missing:  # they all came after all
                return self._read(keys, tag)
            elapsed = time.monotonic() - start
            raise PeerTimeout(f"{what}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                              f"did not answer within the timeout ({elapsed:.2f} s waited, timeout_s="
                              f"{self.timeout_s:g})", missing) from None
        return self._read(keys, tag)

    def _read(self, keys, tag) -> list:
        out = [pickle.loads(self._store.get(k)) for k in keys]
        # every peer wrote this exchange's key, so it has read our previous one: drop it
        for old in self._mine:
            try:
                self._store.delete_key(old)
            except Exception:  # noqa: BLE001 - a store without deletion keeps the key
                pass
        self._mine = [keys[self.rank]]
        return out

    def barrier(self, what: str, tag: str | None = None) -> None:
        self.exchange(None, what, tag)

    def resync(self, n: int) -> None:
        """Start a new epoch of keys (after reset number ``n``, which every rank made)."""
        self._epoch, self._seq = n, 0
