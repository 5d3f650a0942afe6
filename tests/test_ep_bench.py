"""The expert-parallel benchmark's parts that run without GPUs (benchmarks/ep.py, benchmarks/ep_report.py): its
shapes and routing, the two paths it times returning equal tensors (on the host backend), and the report."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
ep_bench = pytest.importorskip("ep")
ep_report = pytest.importorskip("ep_report")


def test_shapes_parse_and_every_rank_routes_its_slice_of_one_draw():
    assert ep_bench.parse_shape("deepseek-v3,4096,zipf") == ("deepseek-v3", 4096, "zipf")
    with pytest.raises(ValueError, match="model one of"):
        ep_bench.parse_shape("mixtral-8x7b,4096,zipf")
    assert len(ep_bench.EP_SHAPES) == 4
    ranks = [SimpleNamespace(world_size=3, rank=r, device=torch.device("cpu")) for r in range(3)]
    got = [ep_bench.rank_routing(c, 5, 16, 4, "zipf") for c in ranks]
    full = ep_bench.routing_ids(15, 16, 4, "zipf")
    assert torch.equal(torch.cat([ids for ids, _ in got]), full)
    for _, w in got:
        assert w.shape == (5, 4) and torch.allclose(w.sum(-1), torch.ones(5))


def _record(model, routing, speed):
    rec = ep_bench.record(SimpleNamespace(world_size=2), model, 4096, routing, "H200", 500.0)
    rec.update({"dispatch_ours_us": 100.0, "dispatch_nccl_us": 100.0 * speed, "combine_ours_us": 80.0,
                "combine_nccl_us": 80.0 * speed, "layer_ours_us": 1000.0, "layer_nccl_us": 1000.0 * speed,
                "dispatch_ours_gbps": 300.0, "combine_ours_gbps": 250.0, "dispatch_equal": True,
                "combine_equal": True})
    return rec


def test_report_writes_table_summary_and_what_it_did_not_measure(tmp_path):
    records = [_record("deepseek-v3", "balanced", 1.0), _record("qwen3-30b-a3b", "zipf", 4.0),
               _record("deepseek-v3", "zipf", 9.0)]
    records[1]["layer_nccl_us"] = None
    records[1]["note"] = "layer: not timed; "
    records[2]["combine_equal"] = False  # left out of the means
    geo = ep_report.write_ep(records, 2, str(tmp_path), pending=[("qwen3-30b-a3b", 4096, "balanced")])
    assert geo["dispatch_vs_nccl"] == pytest.approx(2.0) and geo["layer_vs_nccl"] == pytest.approx(1.0)
    base = os.path.join(tmp_path, "ep-H200x2")
    with open(base + ".md") as f:
        md = f.read()
    assert "| deepseek-v3 | 4096 | balanced | 100.0 | 100.0 | 1.00x | 300 |" in md
    assert md.count("| NO |") == 1 and "| n/a |" in md  # a path that differed is named; the layer not timed
    assert "dispatch over all_to_all_single (target >= 1.5x): 2.000" in md
    assert "Not measured in this run (it ended before them): qwen3-30b-a3b,4096,balanced." in md
    assert "layer: not timed" in md
    with open(base + ".json") as f:
        doc = json.load(f)
    assert doc["op"] == "ep" and doc["world_size"] == 2 and doc["commit"] and len(doc["records"]) == 3
    header_cols = ep_report.EP_HEADER.splitlines()[0].count("|") - 1
    assert ep_report.ep_row(records[0]).count("|") - 1 == header_cols


def _cases():
    """exchange_case and layer_case on a small shape: both paths equal, each timed function runs."""
    import triton_overlap as to

    with to.Context(timeout_s=60) as ctx:
        ops = SimpleNamespace(ours=to.ExpertParallel(ctx, fallback="never", name="t.ep"),
                              nccl=to.ExpertParallel(ctx, fallback="always", name="t.ep.nccl"))
        rec = ep_bench.record(ctx, "qwen3-30b-a3b", 7 + ctx.rank, "zipf", "host", 0.0)
        rec.update(E=8, topk=3, H=40, hidden=24)
        fns = ep_bench.exchange_case(ctx, ops, rec)
        assert rec["dispatch_equal"] and rec["combine_equal"] and rec["path"] == "overlap", rec
        assert rec["dispatch_bytes"] > 0 and rec["rows_received"] > 0
        for fn in fns.values():
            fn()
        fns = ep_bench.layer_case(ctx, rec)
        assert rec["layer_path"] == "overlap" and rec["layer_rel_err"] < 1e-2, rec
        assert rec["layer_overlap_gemm"] == "ag_grouped_gemm", rec  # the first GEMM per source (interpreted)
        assert {"layer_fwd_ours_us", "layer_fwd_overlap_us", "layer_fwd_staged_us", "layer_fwd_nccl_us"} <= set(fns)
        assert rec["layer_staged_rel_err"] < 1e-2, rec
        for fn in fns.values():
            fn()
        ctx.check()


def test_both_paths_agree_and_every_timed_function_runs(pool):
    if pool.backend != "host" or pool.world != 2:
        pytest.skip("host backend, W = 2: the benchmark itself runs on GPUs")
    pool.run(_cases)
