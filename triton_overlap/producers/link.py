"""Between hosts: the process group's point-to-point (NCCL on GPUs) on a producer stream, raising the same per-chunk
flags as the copy engines do within a host, so the consumers wait exactly as they do on one host.

Ranks are placed as ``(host, local index)``. Every host has the same number of ranks, and rank ``(h, i)``'s
counterparts are the ranks ``(h', i)`` of the other hosts. A gather moves each shard across hosts once per host,
between counterparts, and the receiving rank forwards it to its own host's peers by copy engine (a link between
hosts carries ``1 / L`` of what a direct exchange with every remote rank would, for L ranks per host). Partial
outputs (GEMM-ReduceScatter's, attention's dK/dV) for an owner on another host are summed within the host first, by
the rank at the owner's local index, which sends the sum to it (producers.scatter); or, where asked, they go
straight from each rank to each owner on another host.

Each call's first exchange between hosts carries the ranks' call headers (call number, op, fingerprint, sizes), and
a kernel compares them on the device (kernels.signal.remote_header_kernel) before any of the peer's chunks is
flagged ready: the barrier compares headers within a host only. Where exchanges block the host (not NCCL), a
difference is raised before any data moves; over NCCL every wait of the call gives up and the Context reports it.
Data that a kernel of the call made (sums of partials, dK/dV partials, experts' rows) travels with the sender's
error word, which the receiver checks on the device before the data is flagged ready (``Link.exchange``): a peer on
another host does not map this rank's word, and a sender whose wait gave up would otherwise hand it a wrong answer.

The exchanges travel on the Context's ``wire``: over NCCL a communicator of its own (a group over the Context's
ranks), which the Context makes at set-up and again at every reset, while every rank is present (every rank must
join it at once). A ``Watch`` bounds them: NCCL's kernels wait for their peer without end, and an exchange that
never completes (a peer absent, or one whose exchange differs in size) would hold every stream behind it, and the
host's next wait for the device, forever. The Watch times each exchange from the moment its stream reaches it; one
that has not completed within the timeout faults the Context, naming the peer, as a kernel's wait would; and once
the Context is faulted (here, or by a peer), exchanges that are still open are ended by ending the wire's
communicator (``Context.end_wire``), so that every stream drains. The Link is made at the first call that spans
hosts; ``reset()`` lets go of it, and the next such call makes another on the new wire.
"""
from __future__ import annotations

import threading
import time

import torch

from ..kernels import signal as sig
from ..kernels.cached_launch import launch

#: the process group's point-to-point tags start here (clear of small tags a user's own exchanges may use)
TAG_BASE = 1 << 20


def wire_tag(resets: int, seq: int, nccl: bool) -> int:
    """The tag of exchange ``seq`` after ``resets`` resets. Over NCCL a tag is a 31-bit int and the reset count
    wraps at 64: harmless, since every reset makes the wire a new communicator. Through the store (which outlives
    resets, and may keep a key a faulted exchange never took) the reset count is kept whole, so that such a key is
    never taken by a later exchange."""
    if nccl:
        return TAG_BASE + (((resets % 64) << 24) | (seq & 0xFFFFFF)) % ((1 << 31) - TAG_BASE)
    return TAG_BASE + ((resets << 24) | (seq & 0xFFFFFF))


class Link:
    """The Context's point-to-point between hosts (made at the first call that spans hosts, and again after
    ``reset()``).

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
        self.remote = list(topo.remote_ranks(r))
        self.wire = ctx.wire
        if self.wire is None:
            raise RuntimeError(ctx.across_hosts("the link between hosts", "its hosts differ in size, and only hosts of "
                                                "one size have a path between them"))
        self.watch = Watch(ctx, self.wire) if self.wire.nccl else None
        if self.watch is not None:
            ctx.on_reset(self.watch.close)
        self._resets = ctx.resets
        self._seq = 0
        self._headers = torch.zeros((ctx.world_size, sig.HEADER_WORDS), dtype=torch.int32, device=ctx.device)
        #: error words: this rank's row is what it sends along guarded data, the others' what they sent
        self._status = torch.zeros((ctx.world_size, sig.ERR_WORDS), dtype=torch.int32, device=ctx.device)
        self._remote_ids = torch.tensor(self.remote, dtype=torch.int32, device=ctx.device)
        self._mine: dict = {}  # call -> this rank's header to send (its call number filled in on the stream)
        #: the stream the tensors above were zeroed on (the caller's), until a producer stream has waited for it
        self.made_on = ctx.current_stream()

    def next_tag(self) -> int:
        self._seq += 1
        return wire_tag(self._resets, self._seq, self.wire.nccl)

    def exchange(self, stream, sends, recvs, what: str, op: int, waits: dict, guarded: bool = False) -> None:
        """``sends`` and ``recvs``: (tensor, group rank) lists, through ``stream`` (Stream.exchange). ``op`` and
        ``waits`` (group rank -> the chunk, or a WHAT_* code, waited for from that rank) describe a peer that does
        not answer within the timeout: the Context is faulted as a kernel's wait would fault it. With nothing to
        send or receive the exchange takes its tag and moves nothing (no peer sends this rank anything in it).

        ``guarded``: what is sent was made by a kernel of this call whose waits may give up (a sum of the host's
        partials, dK/dV partials, experts' rows), and a peer on another host does not see this rank's error word.
        Each side sends along its error word as it stands on ``stream`` before the exchange, and the receiver
        records a sender's fault before anything that follows on ``stream`` flags the data ready
        (kernels.signal.remote_status_kernel): a fault of the sender's becomes an error of the receiver's, never a
        wrong answer."""
        ctx = self.ctx
        if not sends and not recvs:
            self.next_tag()
            return
        if guarded:
            mine = self._status[ctx.rank]
            stream.copy(mine, ctx.err[:sig.ERR_WORDS])
            froms = sorted({p for _, p in recvs})
            sends = sends + [(mine, p) for p in sorted({p for _, p in sends})]
            recvs = recvs + [(self._status[p], p) for p in froms]
            self._exchange(stream, sends, recvs, what, op, waits)
            if froms:  # (every remote rank's row is read: one a rank did not send in this exchange holds what it
                # sent earlier on this Link, a fault of which is this rank's fault already)
                if ctx.interpreted:  # (the host stream's thread may not run Triton's interpreter: the same in torch)
                    stream.call(lambda: sig.relay_status(self._status, self.remote, ctx.err))
                else:
                    stream.call(lambda: launch(sig.remote_status_kernel, (1,), (
                        self._status, self._remote_ids, len(self.remote), ctx.err), {"N_WORDS": sig.ERR_WORDS}))
            return
        self._exchange(stream, sends, recvs, what, op, waits)

    def _exchange(self, stream, sends, recvs, what: str, op: int, waits: dict) -> None:
        ctx = self.ctx

        def timed_out(late, elapsed):
            peer = late[0]
            what_code = waits.get(peer, int(sig.WHAT_ANSWER))
            raise ctx.faults.record_timeout(op, peer, what_code, elapsed, self._call_number(stream))

        watch = self.watch
        if watch is None:
            stream.exchange(self.wire, sends, recvs, self.next_tag(), f"rank {ctx.rank}: {what}", timed_out)
            return
        watch.refuse_if_aborted()
        with torch.cuda.stream(stream.torch_stream):
            follow = not torch.cuda.is_current_stream_capturing()  # (a captured graph's events cannot be queried)
        begin, end = torch.cuda.Event(), torch.cuda.Event()
        if follow:
            begin.record(stream.torch_stream)
        try:
            stream.exchange(self.wire, sends, recvs, self.next_tag(), f"rank {ctx.rank}: {what}", timed_out)
        except Exception:
            watch.refuse_if_aborted()  # the Watch ended the communicator meanwhile: the Context's fault says why
            raise
        if follow:
            end.record(stream.torch_stream)
            watch.follow(begin, end, op, waits)

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


class Watch:
    """A thread that bounds a Link's exchanges over NCCL, on ``wire`` (see the module's docstring).

    ``follow(begin, end, op, waits)``: events recorded on the exchange's stream before and after it. While one is
    open the thread polls, every 10 ms, whether it has ended, whether this rank's error word says the
    Context faulted (read by a copy on a stream of its own, which no spinning kernel holds up), and, every tenth of
    a second, whether a rank posted a fault in the store. An exchange open for longer than the timeout, counted from
    its ``begin``, is a timeout of the peer in ``waits`` (group rank -> chunk or WHAT_* code): NCCL cannot say which
    of several peers is missing, so the rank posts that it waits, gives the others a moment to post too, and names
    the first of ``waits`` that did not."""

    POLL_S = 0.01
    STORE_POLL_S = 0.1
    GRACE_S = 1.0

    def __init__(self, ctx, wire):
        self.ctx, self.wire = ctx, wire
        self.aborted = False
        self._open: list = []
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"triton_overlap link watch {ctx.rank}", daemon=True)
        self._thread.start()

    def follow(self, begin, end, op: int, waits: dict) -> None:
        with self._lock:
            self._open.append((begin, end, op, dict(waits)))
            self._lock.notify()

    def refuse_if_aborted(self) -> None:
        if self.aborted:
            raise self.ctx.faults.fail(f"rank {self.ctx.rank}: the link between hosts was ended after a fault")

    def close(self) -> None:
        """Stop the thread and end the wire's communicator (an exchange may still be open)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=5)
        self._abort()

    def _abort(self) -> None:
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            self._open.clear()
        self.ctx.end_wire(self.wire)

    def _run(self) -> None:
        ctx = self.ctx
        torch.cuda.set_device(ctx.device)
        side = torch.cuda.Stream(ctx.device)
        peek = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        started, last_store = None, 0.0
        while True:
            with self._lock:
                while not self._open and not self._closed:
                    started = None
                    self._lock.wait()
                if self._closed:
                    return
                begin, end, op, waits = self._open[0]
            if end.query():
                with self._lock:
                    if self._open and self._open[0][1] is end:
                        self._open.pop(0)
                started = None
                continue
            with torch.cuda.stream(side):
                peek[:1].copy_(ctx.err[:1], non_blocking=True)
                peek[1:].copy_(ctx.call_number, non_blocking=True)
            side.synchronize()
            now = time.monotonic()
            if started is None and begin.query():
                started = now
            faulted = ctx.faults.faulted or int(peek[0]) != 0
            if not faulted and started is not None and now - last_store >= self.STORE_POLL_S:
                last_store = now
                faulted = ctx.faults.of_peers()
            if not faulted and started is not None and now - started > ctx.timeout_s:
                self._time_out(op, waits, now - started, int(peek[1]))
                faulted = True
            if faulted:
                self._abort()
                continue
            time.sleep(self.POLL_S)

    def _time_out(self, op: int, waits: dict, elapsed: float, call: int) -> None:
        ctx, peers = self.ctx, list(waits)
        present: list[int] = []
        try:
            ctx.faults.post_waiting()
            t0 = time.monotonic()
            while len(peers) > 1 and time.monotonic() - t0 < self.GRACE_S:
                present = ctx.faults.waiting(peers)
                if len(present) == len(peers) or ctx.faults.of_peers():
                    break
                time.sleep(self.STORE_POLL_S)
        except Exception:  # noqa: BLE001 - the store is gone: name the first peer
            pass
        if ctx.faults.faulted:
            return
        peer = next((p for p in peers if p not in present), peers[0])
        ctx.faults.record_timeout(op, peer, waits[peer], elapsed, call)


def open_call(ctx, stream, call) -> None:
    """A call's opening on ``stream`` (every producer's): the barrier among this host's ranks and, on a group that
    spans hosts, the comparison of call headers with the ranks at this rank's local index on the other hosts (a
    difference anywhere reaches every rank through its host's barrier or its counterparts)."""
    ctx.barrier(stream, call)
    if ctx.num_hosts > 1:
        ln = link(ctx)
        if ln.made_on is not None:  # a new Link: its headers and error words are received into after their zeroing
            stream.wait_stream(ln.made_on)
            ln.made_on = None
        ln.check_call(stream, call, ln.counterparts)


def link(ctx) -> Link:
    """The Context's Link (kept by the Context)."""
    return ctx.cached("link", lambda: Link(ctx))
