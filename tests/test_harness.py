"""The test harness itself (tests/harness.py): a rank that hangs fails the call, and the failure says what it was
doing, its threads' states and its Python stack, and leaves no stack file behind."""
import os
import time

import pytest

from harness import RankPool, _stack_file


def _one_rank_hangs(seconds: float):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(seconds)  # the hang: the pool's timeout ends it
    return dist.get_rank()


def test_a_hung_rank_is_named_with_its_stack():
    pool = RankPool("host", 2)
    pids = [p.pid for p in pool.procs]
    try:
        assert pool.run(_one_rank_hangs, 0.0, timeout=60) == [0, 1]
        with pytest.raises(TimeoutError) as info:
            pool.run(_one_rank_hangs, 60.0, timeout=2)
    finally:
        pool.kill()
    text = str(info.value)
    assert "_one_rank_hangs: ranks [1] did not finish" in text, text
    assert "--- rank 1 (hung) ---" in text and "--- rank 0" not in text, text
    if os.path.isdir("/proc"):
        assert "state S" in text, text  # asleep in time.sleep, not inside a driver call
    assert "in _one_rank_hangs" in text, text  # its Python stack: the line of this module it waited on
    assert not any(os.path.exists(_stack_file(pid)) for pid in pids)
