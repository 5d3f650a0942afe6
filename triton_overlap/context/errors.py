"""A Context's faults: the error word its kernels' waits write, what its slots mean, and the text of a fault.

The error word (int32[kernels.signal.ERR_WORDS], symmetric) records the first fault of a Context: a wait that timed
out, ranks that disagreed on a call, or a fault another rank relayed (written into this rank's word by that rank, so
that every wait here stops too). ``Faults`` turns a word into text, relays this rank's faults to its peers (their
words and the store), and holds the first fault's text, which the Context raises until ``reset()``.

Ops and kernels name an op by ``op_id(name)``, the same number in every process (ranks compare it at every call's
barrier); the names for messages are those the Context was told of (``Faults.name_op``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from ..kernels import signal as sig
from .control import PeerFault, PeerMismatch, PeerOutOfStep, PeerRefused, PeerTimeout


def op_id(name: str) -> int:
    """The id kernels record for op ``name``: the same in every process (a hash of the name), since ranks compare
    them at every call's barrier."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


OP_BARRIER = op_id("barrier")


class ContextError(RuntimeError):
    """A fault of a Context: a wait that timed out, ranks that disagree on a call, a peer that did not answer. After
    one, the Context refuses every call until ``reset()`` (or ``close()``), the way a communicator is aborted."""


@dataclass(frozen=True)
class Call:
    """What a call will read and write, as the ranks compare it at the call's barrier: the op, a fingerprint of
    everything that must match across ranks (shapes, dtypes, chunking), and up to four sizes for messages."""
    op: int
    fingerprint: int
    dims: tuple
    text: str


#: the Context's own barriers (set-up, reset): nothing to compare beyond the call number
OWN_CALL = Call(OP_BARRIER, 0, (0, 0, 0, 0), "its barrier")


class Faults:
    """The faults of one rank's Context. ``control``: its ControlPlane (the store, where faults are posted).

    ``text`` is the first fault's (None: not faulted). ``attach`` hands it the symmetric error word once the
    Context has one; before that a fault is posted in the store only.
    """

    def __init__(self, rank: int, timeout_s: float, control):
        self.rank, self.timeout_s, self.control = rank, timeout_s, control
        self.text: str | None = None
        self.ops: dict[int, str] = {OP_BARRIER: "barrier"}  # op id -> name, for messages
        self.calls: dict[int, str] = {}  # call fingerprint -> what it describes, for messages
        self.errors = self.word = self.seen = self._backend = None
        self._mapped: set = set()

    def attach(self, errors, backend, mapped: set) -> None:
        """Use ``errors`` (the symmetric error word; ``word`` is this rank's) with ``backend``, which writes into
        the peers' words (``mapped``: the ranks whose memory this rank maps) and keeps ``seen``, a host copy of the
        word read without synchronising (None where the host reads ``word`` itself)."""
        self.errors, self.word, self._backend, self._mapped = errors, errors.local, backend, mapped
        self.seen = backend.error_mirror(self.word)

    # ------------------------------------------------------------------------------------------- names
    def name_op(self, name: str) -> int:
        """``op_id(name)``, named ``name`` in this Context's messages."""
        k = op_id(name)
        self.ops[k] = name
        return k

    def op_name(self, op: int) -> str:
        return self.ops.get(op, f"op#{op}")

    def call(self, op: int, descriptor: tuple, dims=()) -> Call:
        """The header of a call (Context.call); its text is kept for messages."""
        text = " ".join(str(d) for d in descriptor)
        fingerprint = zlib.crc32(f"{op}:{text}".encode()) & 0x7FFFFFFF
        self.calls[fingerprint] = text
        dims = (tuple(int(d) for d in dims) + (0, 0, 0, 0))[:4]
        return Call(op, fingerprint, dims, text)

    def describe(self, word) -> str:
        """The text of the fault in error word ``word``."""
        op = self.op_name(word[sig.ERR_OP])
        rank, peer, call = word[sig.ERR_RANK], word[sig.ERR_PEER], word[sig.ERR_CALL]
        if word[sig.ERR_CODE] == sig.ERR_MISMATCH:
            h = word[sig.ERR_PEER_HEADER:sig.ERR_PEER_HEADER + sig.HEADER_WORDS]
            peer_op = self.op_name(h[1])
            mine = self.calls.get(word[sig.ERR_OWN_FINGERPRINT], "")
            theirs = self.calls.get(h[2]) or "sizes " + " x ".join(str(d) for d in h[3:7] if d)
            if h[0] != call:
                return (f"rank {rank}: call {call} ({op} {mine}) meets rank {peer} at its call {h[0]} ({peer_op} "
                        f"{theirs}): the ranks' calls are out of step")
            if h[2] == word[sig.ERR_OWN_FINGERPRINT] and word[sig.ERR_SEEN] != h[3]:  # a low-latency combine
                return (f"rank {rank}: call {call}: {op} of dispatch {word[sig.ERR_SEEN]} on this rank, of dispatch "
                        f"{h[3]} on rank {peer}: ranks must combine the same dispatch")
            return (f"rank {rank}: call {call}: ranks disagree on the call: rank {rank} called {op} {mine}, rank "
                    f"{peer} called {peer_op} {theirs}")
        what = word[sig.ERR_WHAT]
        if word[sig.ERR_CODE] == sig.ERR_BAD_IDS:
            return (f"rank {rank}: {op} (call {call}): rank {peer} passed expert ids from {word[sig.ERR_SEEN]} to "
                    f"{word[sig.ERR_WANTED]}; topk_ids must lie in [0, {what}) (E = {what} experts)")
        waited = ("the ranks' programs to start" if what == sig.WHAT_STARTED
                  else f"rank {peer}'s call to start (before storing into its receive slot)"
                  if what == sig.WHAT_PEER_STARTED
                  else f"rank {peer} to arrive at the call's barrier" if what == sig.WHAT_ARRIVAL
                  else f"rank {peer}'s dK/dV partials" if what == sig.WHAT_PARTIALS
                  else f"this rank's own GEMM tiles of rank {peer}'s rows" if what == sig.WHAT_OWN_TILES
                  else f"rank {peer}'s answer" if what == sig.WHAT_ANSWER
                  else f"chunk {what} of rank {peer}")
        if word[sig.ERR_CODE] == sig.ERR_RELAYED:  # (the word alone: the rank's own text was not posted yet)
            origin = word[sig.ERR_ORIGIN_CODE]
            why = (f"its call disagrees with rank {peer}'s" if origin == sig.ERR_MISMATCH
                   else f"rank {peer} passed expert ids out of range" if origin == sig.ERR_BAD_IDS
                   else f"waiting for {waited}")
            return f"rank {rank} faulted ({op}{f' call {call}' if call else ''}: {why})"
        return (f"rank {rank}: {op} (call {call}) timed out after {word[sig.ERR_ELAPSED_US] / 1e6:.2f} s "
                f"(timeout_s={self.timeout_s:g}) waiting for {waited} (saw {word[sig.ERR_SEEN]}, waited for "
                f"{word[sig.ERR_WANTED]}){self._refused(peer)}")

    def _refused(self, peer: int) -> str:
        """Why ``peer`` did not come, where it refused this rank's current or latest call (ControlPlane.refuse): a
        fault on GPUs is read after the call or at the next call's start."""
        phase = self.control.phase
        for p in (phase, phase - 1, phase - 2) if peer != self.rank else ():
            if p % 2:
                try:
                    note = self.control.note(peer, p)
                except Exception:  # noqa: BLE001 - the store is gone: the word alone
                    return ""
                if note is not None:
                    return f"; rank {peer}'s call raised before it launched: {note[1]}"
        return ""

    def refuse(self, error: Exception) -> ContextError | None:
        """This rank's call raised ``error`` on the host before launching anything (ControlPlane.refuse). None where
        every peer settled it (they raise too); else the ContextError to raise: the Context is faulted and the
        peers told, since a peer launched the call and this rank's next call must not meet it."""
        text = f"{type(error).__name__}: {error}"
        try:
            late = self.control.refuse(text)
        except PeerFault as e:
            return self.peer_faulted(e.rank, str(e))
        except Exception:  # noqa: BLE001 - the store is gone (the group destroyed): the call's own error stands
            return None
        if late is None:
            return None
        peer, why = late
        return self._unanswered(f"rank {self.rank}: {text}; {why}", peer)

    # ------------------------------------------------------------------------------------------ faults
    def exchange(self, obj, what: str, tag: str | None = None) -> list:
        """Every rank's ``obj`` through the control plane (bounded, ControlPlane.exchange); a missing peer, or a
        peer's fault, faults the Context."""
        try:
            return self.control.exchange(obj, what, tag)
        except PeerTimeout as e:
            raise self._unanswered(f"rank {self.rank}: {e}", e.missing[0]) from None
        except PeerFault as e:
            raise self.peer_faulted(e.rank, str(e)) from None
        except PeerRefused as e:  # the call ends on every rank as on the one that raised; none is faulted
            raise ValueError(f"{what}: rank {e.rank} raised before it came: {e}") from None
        except PeerMismatch as e:  # every rank sees it and raises: the call ends as a refusal (refuse)
            raise ValueError(f"{what}: rank {e.rank} came to another exchange of this call ({e.what}): the ranks' "
                             f"calls differ (an input of another shape or setting on some rank?)") from None
        except PeerOutOfStep as e:
            raise self._unanswered(f"rank {self.rank}: {e}", e.rank) from None

    def _unanswered(self, text: str, peer: int) -> ContextError:
        """Fault with ``text``, a host-side wait on ``peer`` that ended without its answer, relayed to the peers."""
        return self.fail(text, (sig.ERR_RELAYED, self.rank, 0, peer, sig.WHAT_ANSWER))

    def fail(self, text: str, relay=None) -> ContextError:
        """Fault the Context with ``text`` (the first fault's text stays) and return the error to raise. ``relay``:
        (code, rank, op, peer, what) of an error word to write into every peer's, so that their waits stop at once;
        None for a fault the peers know of already."""
        if self.text is None:
            self.text = f"triton_overlap: {text}"
            if relay is not None:
                self._relay(self.text, relay)
        return ContextError(self.text)

    def _relay(self, text: str, fields) -> None:
        """Post this rank's fault in the store (for peers waiting in an exchange, and for the text of messages) and
        write it into every peer's error word (for their kernels' waits), unless a peer has a fault of its own."""
        try:
            self.control.post_fault(text)
            word = [0] * sig.ERR_WORDS
            code, rank, op, peer, what = (int(f) for f in fields)
            word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_RELAYED), rank, op
            word[sig.ERR_PEER], word[sig.ERR_WHAT], word[sig.ERR_ORIGIN_CODE] = peer, what, code
            for p in self._mapped - {self.rank}:  # ranks on other hosts learn it from the store
                self._backend.relay_error(self.errors.peer(p), word)
        except Exception:  # noqa: BLE001 - telling the peers is best effort: their own waits are bounded anyway
            pass

    def record_timeout(self, op: int, peer: int, what: int, elapsed_s: float, call: int) -> ContextError:
        """Fault with a wait outside the kernels (an exchange between hosts) that timed out, as a kernel's wait
        records it: this rank's word is set, so that its kernels' waits stop at once, and the peers are told.
        Returns the error to raise."""
        word = [0] * sig.ERR_WORDS
        word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_TIMEOUT), self.rank, op
        word[sig.ERR_PEER], word[sig.ERR_WHAT], word[sig.ERR_WANTED] = peer, what, 1
        word[sig.ERR_ELAPSED_US], word[sig.ERR_CALL] = int(elapsed_s * 1e6), call
        word[sig.ERR_OWN_CODE] = int(sig.ERR_TIMEOUT)
        try:
            self._backend.relay_error(self.word, word)
        except Exception:  # noqa: BLE001 - the host-side fault below stands on its own
            pass
        return self.fail(self.describe(word), (word[sig.ERR_CODE], self.rank, op, peer, what))

    def observe(self, word) -> None:
        """Fault with the fault in error word ``word`` (this rank's own, or one a peer relayed)."""
        word = list(word)
        if word[sig.ERR_CODE] == sig.ERR_RELAYED and word[sig.ERR_RANK] == self.rank:
            # no rank relays to itself: a peer's relay (fields, then its code) met this rank's own kernel recording
            # a fault (its code by compare-and-swap while the code was still 0, then its fields, its code again in
            # ERR_OWN_CODE), so the fields are this rank's own and only the code is the peer's.
            word[sig.ERR_CODE] = int(word[sig.ERR_OWN_CODE] or (sig.ERR_MISMATCH if word[sig.ERR_OWN_FINGERPRINT]
                                                                 else sig.ERR_TIMEOUT))
        if word[sig.ERR_CODE] == sig.ERR_RELAYED:
            origin = word[sig.ERR_RANK]
            try:
                text = self.control.fault_text(origin)
            except Exception:  # noqa: BLE001 - the store is gone: the word alone
                text = None
            self.peer_faulted(origin, text or self.describe(word))
        else:
            self.fail(self.describe(word), (word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP],
                                            word[sig.ERR_PEER], word[sig.ERR_WHAT]))

    @property
    def faulted(self) -> bool:
        """Whether the Context is faulted, as far as the host has seen (it refuses calls then)."""
        return self.text is not None

    def post_waiting(self) -> None:
        """Tell the other ranks that this rank waits, past its timeout, in an exchange between hosts."""
        self.control.post_waiting()

    def waiting(self, ranks) -> list[int]:
        """Those of ``ranks`` that posted ``post_waiting`` since the last reset (they are present)."""
        return self.control.waiting(ranks)

    def peer_faulted(self, rank: int, text: str) -> ContextError:
        """Fault with rank ``rank``'s posted fault ``text``; return the error to raise."""
        return self.fail(f"rank {self.rank}: rank {rank} faulted: {text.removeprefix('triton_overlap: ')}")

    def of_peers(self) -> bool:
        """Fault if another rank posted a fault of its own (how ranks on other hosts, whose words this rank does
        not map, learn of one); say whether the Context is faulted."""
        if self.text is None:
            got = self.control.fault_of_others()
            if got is not None:
                self.peer_faulted(*got)
        return self.text is not None

    def poll(self) -> None:
        """Fault with a fault the host copy of the word holds, if it is not seen yet (without synchronising)."""
        if self.text is None and self.seen is not None and self.seen[0] != 0:
            self.observe([int(v) for v in self.seen])

    def read(self) -> bool:
        """Read this rank's word (synchronises with the device); fault with what it holds, and say whether it
        held a fault not seen before."""
        word = self.word.tolist()
        if word[sig.ERR_CODE] != 0 and self.text is None:
            self.observe(word)
            return True
        return False

    def zero_word(self) -> None:
        """Zero this rank's word, but the host backend's clock, which runs on."""
        now = int(sig.ERR_NOW_MS)
        self.word[:now].zero_()
        self.word[now + 1:].zero_()

    def clear(self, device_type: str) -> None:
        """Zero the word's host copy (where it is a copy) and stop refusing calls: the end of a reset."""
        if self.seen is not None and device_type != "cpu":  # a copy of the word (the host backend's is it)
            self.seen[:] = 0
        self.text = None
