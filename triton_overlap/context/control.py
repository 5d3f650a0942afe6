"""The Context's host-side exchanges, each bounded by a timeout and naming the ranks that did not answer.

A process group's own collectives wait as long as the group's timeout (minutes, by default), and a missing rank
shows as a hang or as an error that does not say which rank is missing. The Context's host-side steps (agreeing
on shapes, exchanging memory handles, the barriers of set-up, growth, reset and close) go instead through the key-
value store the process group was set up with: every rank writes its part under a key of its own and reads every
peer's, waiting at most the Context's timeout, so a rank that never writes is named. A rank whose Context faults
posts the fault's text there too, and a peer waiting in an exchange stops at once with it.
"""
from __future__ import annotations

import itertools
import pickle
import threading
import time

import torch.distributed as dist

_contexts = itertools.count()  # Contexts made in this process: every rank makes them in the same order


class PeerTimeout(RuntimeError):
    """Ranks did not answer a host-side exchange in time. ``missing``: their ranks in the group."""

    def __init__(self, msg: str, missing: list[int]):
        super().__init__(msg)
        self.missing = missing


class PeerRefused(RuntimeError):
    """Another rank's call raised on the host before launching anything (ControlPlane.refuse), so it will not come
    to the exchange this rank waits in (``rank``: that rank, the text its error's)."""

    def __init__(self, rank: int, text: str):
        super().__init__(text)
        self.rank = rank


class PeerOutOfStep(RuntimeError):
    """A rank's part of a host-side exchange came from another of its calls than this rank's (``rank``: that
    rank): one rank went on past a call that its peers are still in."""

    def __init__(self, msg: str, rank: int):
        super().__init__(msg)
        self.rank = rank


class PeerMismatch(RuntimeError):
    """A rank's part of a host-side exchange came from the same call as this rank's but from another of its
    exchanges (``rank``: that rank, ``what``: its exchange's name): the ranks' calls took different courses on the
    host (an agreement one rank skips for a shape it has passed before, say), so no rank may use the parts."""

    def __init__(self, rank: int, what: str):
        super().__init__(what)
        self.rank, self.what = rank, what


class PeerFault(RuntimeError):
    """Another rank's Context faulted while this rank waited for it (``rank``: that rank, the text its fault's)."""

    def __init__(self, rank: int, text: str):
        super().__init__(text)
        self.rank = rank


#: the tag of Context.close's barrier: a rank that posted its part there launches nothing more
CLOSE = "close"


def _default_store():
    """The key-value store torch.distributed was initialised with (torch keeps it with the default group)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class ControlPlane:
    """Bounded host-side exchanges among the ranks of ``group``.

    ``exchange(obj, what)``: every rank's ``obj``, in group-rank order. Keys carry an epoch (bumped by
    ``resync``) and a sequence number, so a late rank's writes from before a fault never satisfy a later exchange.
    """

    def __init__(self, group, rank: int, world: int, timeout_s: float, store=None):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        name = getattr(group, "group_name", None) or "world"
        #: the process group's store under this Context's prefix (``store``: another, e.g. a torch HashStore)
        self._store = store or dist.PrefixStore(f"triton_overlap/{name}/{next(_contexts)}", _default_store())
        self._epoch = 0
        self._seq = 0
        self._mine: list[str] = []  # our exchange keys still in the store
        #: where this rank is among op calls, alike on every rank: odd inside the outermost call of an op, even
        #: between calls (each call adds 2); every sequenced exchange carries it (begin_call, end_call)
        self.phase = 0
        self._local = threading.local()  # depth: op calls in progress on this thread (an op may call another)
        self._refused = None  # (phase, exchange) of this rank's latest refusal (refuse)
        self._notes: list[str] = []  # our refusal notes still in the store

    @property
    def store(self):
        """The store (under this Context's prefix)."""
        return self._store

    # ---------------------------------------------------------------------------------------- faults
    def post_fault(self, text: str) -> None:
        """Tell the other ranks this rank's Context faulted, with what happened."""
        self._store.set(f"e{self._epoch}/fault/{self.rank}", text.encode())
        self._store.add(f"e{self._epoch}/faults", 1)

    def post_waiting(self) -> None:
        """Tell the other ranks this rank is waiting, past its timeout, in an exchange between hosts (the exchange
        cannot say which peer is missing: a peer that posts this is present)."""
        self._store.set(f"e{self._epoch}/waiting/{self.rank}", b"")

    def waiting(self, ranks) -> list[int]:
        """Those of ``ranks`` that posted ``post_waiting`` in this epoch."""
        return [r for r in ranks if self._store.check([f"e{self._epoch}/waiting/{r}"])]

    def fault_of_others(self):
        """(rank, text) of another rank's posted fault in this epoch, or None."""
        if self._store.add(f"e{self._epoch}/faults", 0) == 0:
            return None
        for r in range(self.world):
            key = f"e{self._epoch}/fault/{r}"
            if r != self.rank and self._store.check([key]):
                return r, self._store.get(key).decode()
        return None

    def fault_text(self, rank: int) -> str | None:
        """The text rank ``rank`` posted with its fault in this epoch, if any."""
        key = f"e{self._epoch}/fault/{rank}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    # -------------------------------------------------------------------------------------- refusals
    def begin_call(self) -> bool:
        """An op call starts on this thread; True where it is the outermost (the phase turns odd)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self.phase += 1
        return depth == 0

    def end_call(self, outer: bool) -> None:
        """The call ``begin_call`` started ends (the outermost: the phase turns even)."""
        self._local.depth -= 1
        if outer:
            self.phase += 1

    def refuse(self, text: str) -> tuple | None:
        """This rank's current call raised (``text``) on the host, before launching anything: tell the peers and wait
        until each is settled. A peer waiting for this rank in the call's next exchange reads the note, takes its
        part back and raises too (PeerRefused); a peer that refused the call as well posted a note of its own; a
        peer in ``Context.close`` launches nothing more. Returns None once every peer is one of these; else (peer,
        why): a peer went on past the call without an exchange (it launched the call and waits for this rank on the
        device), or did not come within the timeout, and the caller faults the Context, so that this rank's next
        call never meets the peer's launch of this one. Raises PeerFault if a peer faulted meanwhile."""
        phase, seq = self.phase, self._seq
        key = self._note_key(self.rank, phase)
        self._refused = (phase, seq)
        self._store.set(key, pickle.dumps((seq, text)))
        self._store.add(f"e{self._epoch}/refusals", 1)
        self._notes.append(key)
        keys = [f"e{self._epoch}/x{seq}/{r}" for r in range(self.world)]
        pending = [r for r in range(self.world) if r != self.rank]
        start, pause = time.monotonic(), 2e-4
        while pending:
            for r in list(pending):
                part = pickle.loads(self._store.get(keys[r])) if self._store.check([keys[r]]) else False
                if (part is None or (part and part[0] == phase) or (self.note(r, phase) or (None,))[0] == seq
                        or self._store.check([f"{CLOSE}/{r}"])):
                    pending.remove(r)  # withdrawn after reading the note, waiting there, refused too, or closing
                elif part and part[0] > phase:
                    return r, f"rank {r} went on past the call without an exchange (it launched it)"
            fault = self.fault_of_others() if pending else None
            if fault is not None:
                raise PeerFault(*fault)
            if pending and time.monotonic() - start > self.timeout_s:
                return pending[0], (f"rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} did not "
                                    f"come to the call's exchange within the timeout (timeout_s={self.timeout_s:g}): "
                                    f"{'they' if len(pending) > 1 else 'it'} launched the call, or wait elsewhere")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return None

    def note(self, rank: int, phase: int) -> tuple | None:
        """``rank``'s refusal of its call at ``phase`` in this epoch: (the exchange it did not come to, the text)."""
        key = self._note_key(rank, phase)
        return pickle.loads(self._store.get(key)) if self._store.check([key]) else None

    def _note_key(self, rank: int, phase: int) -> str:
        return f"e{self._epoch}/refused/{rank}/{phase}"

    def _refused_by(self, rank: int, seq: int, keys: list) -> None:
        """Raise PeerRefused if ``rank`` refused this rank's current call at exchange ``seq``, taking back this rank's
        part and number first, so that its next exchange is numbered as the refusing rank's is."""
        note = self.note(rank, self.phase)
        if note is None or note[0] != seq:
            return
        self._store.set(keys[self.rank], pickle.dumps(None))  # withdrawn (not deleted: a peer may be reading it)
        self._seq = seq
        self._refused = (self.phase, seq)  # (this call ends here too: a peer's part of it is stale from now on)
        raise PeerRefused(rank, note[1])

    # --------------------------------------------------------------------------------------- exchanges
    def exchange(self, obj, what: str, tag: str | None = None, wait_s: float | None = None) -> list:
        """Every rank's ``obj`` (a collective), waiting at most ``wait_s`` (default ``timeout_s``): PeerTimeout
        names the ranks whose part did not come, PeerFault says a rank that faulted meanwhile, PeerRefused one that
        raised before coming (``refuse``), PeerOutOfStep one whose part belongs to another call, PeerMismatch one
        whose part belongs to another exchange of this call (``what`` names the exchange). ``tag``: a key of its
        own (reset and close use fixed ones, and take any rank's part), else the next in sequence."""
        seq = None
        if tag is None:
            seq = self._seq
            tag = f"e{self._epoch}/x{seq}"
            self._seq += 1
        store = self._store
        keys = [f"{tag}/{r}" for r in range(self.world)]
        store.set(keys[self.rank], pickle.dumps((self.phase, what, obj)))
        if keys[self.rank] not in self._mine:  # (deleted once every peer is past it, even where this one raises)
            self._mine.append(keys[self.rank])
        parts = {self.rank: obj}
        wait_s = self.timeout_s if wait_s is None else wait_s
        refusals = f"e{self._epoch}/refusals"
        start = time.monotonic()
        pause = 2e-4
        while True:
            missing = [r for r in range(self.world) if r not in parts]
            if missing and store.check([keys[r] for r in missing]):
                ready = missing  # (the usual case: one look for all)
            else:
                ready = [r for r in missing if store.check([keys[r]])] if len(missing) > 1 else []
            for r in ready:
                part = pickle.loads(store.get(keys[r]))
                if part is None:  # withdrawn: its rank will post again
                    continue
                phase, label, got = part
                if seq is None or phase == self.phase:
                    if seq is not None and label != what:  # (every rank sees a differing part: they all raise)
                        raise PeerMismatch(r, label)
                    parts[r] = got
                elif self._refused != (phase, seq):  # (else: its part of the call this rank refused, which it
                    self._refused_by(r, seq, keys)   # takes back: wait for its next)
                    raise PeerOutOfStep(f"{what}: rank {r} came from another call than this rank's (phase {phase}, "
                                        f"this rank {self.phase}: odd within a call): the ranks' calls are out of "
                                        f"step", r)
            if len(parts) == self.world:
                break
            missing = [r for r in range(self.world) if r not in parts]
            if tag.startswith(f"e{self._epoch}/"):  # (reset and close go on whatever a peer posted)
                fault = self.fault_of_others()
                if fault is not None and not store.check([keys[r] for r in missing]):  # (a rank that faulted
                    raise PeerFault(*fault)  # after this exchange had every part does not make it fail: read them)
            if seq is not None and store.add(refusals, 0):
                for r in missing:
                    self._refused_by(r, seq, keys)
            elapsed = time.monotonic() - start
            if elapsed > wait_s:
                raise PeerTimeout(f"{what}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
                                  f" did not answer within the timeout ({elapsed:.2f} s waited, "
                                  f"{'timeout_s=' if wait_s == self.timeout_s else 'allowed '}{wait_s:g})", missing)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        out = [parts[r] for r in range(self.world)]
        # every peer wrote this exchange's key, so it has read our previous ones: drop them
        for old in self._mine:
            if old == keys[self.rank]:
                continue
            try:
                store.delete_key(old)
            except Exception:  # noqa: BLE001 - a store without deletion keeps the key
                pass
        self._mine = [keys[self.rank]]
        if seq is not None:  # every peer is past the calls our notes refused
            for old in self._notes:
                try:
                    store.delete_key(old)
                except Exception:  # noqa: BLE001 - a store without deletion keeps it: it names a past phase
                    pass
            self._notes = []
        return out

    def barrier(self, what: str, tag: str | None = None, wait_s: float | None = None) -> None:
        self.exchange(None, what, tag, wait_s)

    def resync(self, n: int) -> None:
        """Start a new epoch of keys (after reset number ``n``, which every rank made)."""
        self._epoch, self._seq, self.phase, self._refused, self._notes = n, 0, 0, None, []
