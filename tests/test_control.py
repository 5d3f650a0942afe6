"""The host's control plane alone (context.control.ControlPlane): two or three ranks as threads sharing one torch
HashStore, so each interleaving of a call refused on one rank is made on purpose. A refusal must end every rank's
call alike (each raises) and leave the exchanges in step, or, where a peer went on past the call, fault; never pair
parts of different calls."""
import threading

import pytest
import torch.distributed as dist

from triton_overlap.context.control import ControlPlane, PeerMismatch, PeerOutOfStep, PeerRefused

T = 2.0  # each plane's timeout (s)


def planes(world: int):
    store = dist.HashStore()
    return [ControlPlane(None, r, world, T, store=store) for r in range(world)]


def run(*fns):
    """Each fn on a thread of its own; their results (or the exception each raised), in order."""
    out = [None] * len(fns)

    def one(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - the result under test
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * T)
    return out


def call(plane, body):
    """``body()`` inside one op call of ``plane`` (its phase odd meanwhile)."""
    outer = plane.begin_call()
    try:
        return body()
    finally:
        plane.end_call(outer)


def test_exchange_in_step():
    a, b, c = planes(3)
    got = run(*(lambda p=p: call(p, lambda: p.exchange(p.rank, "x")) for p in (a, b, c)))
    assert got == [[0, 1, 2]] * 3
    assert a.phase == b.phase == c.phase == 2


@pytest.mark.parametrize("world", [2, 3])
def test_refused_while_peers_wait_then_in_step(world):
    """The last rank refuses; the others wait for it in the call's exchange: they raise PeerRefused, it settles
    (None), and the next call's exchange pairs the right parts, though the refusing rank starts it at once."""
    ps = planes(world)
    last = ps[-1]

    def waiting(p):
        def body():
            with pytest.raises(PeerRefused, match="bad input") as info:
                p.exchange(("call 1", p.rank), "agree")
            assert p.refuse(f"ValueError: {info.value}") is None  # as an op's call does (ops.base._counted)
        call(p, body)
        return call(p, lambda: p.exchange(("call 2", p.rank), "agree"))

    def refusing():
        assert call(last, lambda: last.refuse("ValueError: bad input")) is None
        return call(last, lambda: last.exchange(("call 2", last.rank), "agree"))

    got = run(*(lambda p=p: waiting(p) for p in ps[:-1]), refusing)
    assert got == [[("call 2", r) for r in range(world)]] * world, got


def test_every_rank_refuses():
    ps = planes(3)
    assert run(*(lambda p=p: call(p, lambda: p.refuse(f"ValueError: rank {p.rank}")) for p in ps)) == [None] * 3
    got = run(*(lambda p=p: call(p, lambda: p.exchange(p.rank, "next")) for p in ps))
    assert got == [[0, 1, 2]] * 3


def test_refused_while_peer_went_on():
    """The peer made no exchange in the call (its shape agreed before: it launched it) and one after it: the
    refusing rank is told at once, naming the peer, and must fault."""
    a, b = planes(2)

    def went_on():
        call(a, lambda: None)  # launched, no exchange
        return a.exchange("after", "between calls", wait_s=T / 4)

    got = run(went_on, lambda: call(b, lambda: b.refuse("ValueError: bad input")))
    assert got[1][0] == 0 and "went on past the call" in got[1][1], got
    assert isinstance(got[0], Exception)  # its exchange found no partner


def test_refused_while_peer_never_comes():
    a, b = planes(2)
    got = call(b, lambda: b.refuse("ValueError: bad input"))
    assert got[0] == 0 and "did not come" in got[1], got


def test_parts_of_different_calls_never_pair():
    """Rank 1 is a call ahead (its previous call made no exchange on rank 0's side): PeerOutOfStep on both."""
    a, b = planes(2)
    call(b, lambda: None)
    got = run(lambda: call(a, lambda: a.exchange("a", "x")), lambda: call(b, lambda: b.exchange("b", "x")))
    assert all(isinstance(g, PeerOutOfStep) for g in got), got


@pytest.mark.parametrize("world", [2, 3])
def test_parts_of_different_exchanges_never_pair(world):
    """The last rank skips the call's first exchange (an agreement on a shape it had passed before): its second
    meets the others' first. Every rank raises PeerMismatch naming the other exchange, each settles its refusal
    (None), and the next call pairs the right parts; then no rank's part of an earlier exchange is left in the
    store."""
    ps = planes(world)

    def one(p, names):
        def body():
            with pytest.raises(PeerMismatch) as info:
                for name in names:
                    p.exchange((name, p.rank), name)
            assert info.value.what in ("shapes", "routing") and info.value.what != names[0]
            assert p.refuse(f"ValueError: {info.value}") is None
        call(p, body)
        return call(p, lambda: p.exchange(("next", p.rank), "shapes"))

    got = run(*(lambda p=p: one(p, ("shapes", "routing")) for p in ps[:-1]), lambda: one(ps[-1], ("routing",)))
    assert got == [[("next", r) for r in range(world)]] * world, got
    store = ps[0]._store
    for p in ps:
        left = [s for s in range(p._seq) if store.check([f"e{p._epoch}/x{s}/{p.rank}"])]
        assert left == [p._seq - 1], (p.rank, left)  # the last exchange's part only
