"""The launch cache's specialisation key (kernels.cached_launch._spec): arguments that Triton compiles apart must
get different keys, and equal ones the same, whatever their Python type (exact ints, bools, tuples, tensors and
their subclasses), or a cached launch would run a kernel built for another specialisation; and one entry serves
every grid (on a GPU)."""
import enum
from collections import namedtuple

import pytest
import torch
import triton
import triton.language as tl

from triton_overlap.kernels import cached_launch
from triton_overlap.kernels.cached_launch import _spec, launch, triton_interprets


class Width(enum.IntEnum):
    SIXTEEN = 16


def test_ints_by_value_class():
    assert _spec(1) == (True, False, True, False)
    assert _spec(0) == (False, True, True, False) and _spec(4096) == (False, True, True, False)
    assert _spec(7) == (False, False, True, False) and _spec(-3) == (False, False, True, False)
    assert _spec(1 << 31) == (False, True, False, False) and _spec(-(1 << 31)) == (False, True, True, False)
    assert _spec(1 << 63) != _spec(1 << 40)  # Triton's u64 and i64
    assert _spec(Width.SIXTEEN) == _spec(16)  # an int subclass: by its value


def test_bools_apart_from_ints():
    assert _spec(True) == ("b", True) and _spec(False) == ("b", False)
    assert _spec(True) != _spec(1) and _spec(False) != _spec(0)


def test_tensors_by_dtype_and_alignment():
    t = torch.empty(64, dtype=torch.bfloat16)
    assert _spec(t) == (torch.bfloat16, t.data_ptr() % 16 == 0)
    assert _spec(t[1:]) == (torch.bfloat16, False)  # 2 bytes past an aligned start
    assert _spec(t.float()) != _spec(t)
    p = torch.nn.Parameter(t.clone())
    assert _spec(p) == (torch.bfloat16, p.data_ptr() % 16 == 0)


def test_tuples_item_by_item():
    t = torch.empty(8, dtype=torch.int32)
    assert _spec((t, 3, 1, True)) == (_spec(t), _spec(3), _spec(1), _spec(True))
    Pair = namedtuple("Pair", "a b")
    assert _spec(Pair(t, 16)) == (_spec(t), _spec(16))
    assert _spec(((1, 2), 32)) == ((_spec(1), _spec(2)), _spec(32))


def test_anything_else_by_type():
    assert _spec(None) is type(None) and _spec(1.5) is float


@triton.jit
def _fill(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)


@pytest.mark.skipif(not torch.cuda.is_available() or triton_interprets(), reason="the cache serves GPU launches")
def test_one_entry_serves_every_grid():
    """Calls whose sizes differ (within a value class) reuse one compiled kernel, each on its own grid."""
    before = len(cached_launch._compiled)
    for n in (100, 1000, 5000):  # (none a multiple of 16: one specialisation)
        out = torch.full((n,), -1.0, device="cuda")
        launch(_fill, (triton.cdiv(n, 128),), (out, n), dict(BLOCK=128))
        torch.cuda.synchronize()
        assert torch.equal(out, torch.arange(n, device="cuda", dtype=torch.float32)), n
    assert len(cached_launch._compiled) == before + 1
