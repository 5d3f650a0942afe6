"""The MoE benchmark's parts that run without GPUs (benchmarks/moe.py, benchmarks/moe_report.py): the routings it
draws, its torch baseline layer and our grouped GEMM run alone (against TPMoE and torch on the host backend), and
the report it writes."""
import json
import os
import sys
from dataclasses import replace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
moe_bench = pytest.importorskip("moe")
moe_report = pytest.importorskip("moe_report")


def test_routings_are_seeded_distinct_and_skewed_as_named():
    for E, topk in ((8, 2), (128, 8), (256, 8), (3, 3)):
        ids = {kind: moe_bench.routing_ids(4096, E, topk, kind) for kind in moe_bench.ROUTINGS}
        for kind, t in ids.items():
            assert t.shape == (4096, topk) and t.dtype == torch.int64 and 0 <= int(t.min()) and int(t.max()) < E
            assert (t.sort(1).values.diff(dim=1) > 0).all(), "a token chose one expert twice"
            assert torch.equal(t, moe_bench.routing_ids(4096, E, topk, kind)), "not the same on every rank"
        if topk < E:  # the busiest expert's load over the mean: 1.01 to 1.26 balanced, 2.5 to 25 Zipf
            balanced, zipf = (moe_bench.load_imbalance(ids[k], E) for k in ("balanced", "zipf"))
            assert balanced < 1.4 < 2 < zipf, (E, topk, balanced, zipf)
    with pytest.raises(ValueError, match="topk"):
        moe_bench.routing_ids(4, 2, 3, "balanced")
    with pytest.raises(ValueError, match="kind"):
        moe_bench.routing_ids(4, 8, 2, "uniform")
    assert moe_bench.parse_shape("deepseek-v3,4096,zipf") == ("deepseek-v3", 4096, "zipf")
    with pytest.raises(ValueError, match="model one of"):
        moe_bench.parse_shape("mixtral,4096,zipf")
    assert len(moe_bench.MOE_SHAPES) == 12


def _record(model, tokens, routing, speed):
    E, topk, K, N = moe_bench.MODELS[model]
    rec = {"model": model, "E": E, "topk": topk, "K": K, "N": N, "tokens_per_rank": tokens, "routing": routing,
           "world_size": 2, "gpu": "H200", "note": "", "lead_us": 500.0, "zipf_exponent": 1.0, "imbalance": 1.1,
           "layer_torch_us": 300.0 * speed, "layer_ours_us": 200.0, "layer_ours_fwd_us": 80.0,
           "layer_torch_fwd_us": 100.0}
    for op in ("ag", "rs"):
        rec.update({f"{op}_ours_us": 100.0, f"{op}_ours_sorted_us": 95.0, f"{op}_user_us": 105.0,
                    f"{op}_nccl_us": 150.0 * speed, f"{op}_bound_us": 90.0, f"{op}_consumer_only_us": 92.0})
    return rec


def test_report_writes_tables_summary_and_what_it_did_not_measure(tmp_path):
    records = [_record("mixtral-8x7b", 4096, "balanced", 1.0), _record("qwen3-30b-a3b", 4096, "zipf", 4.0)]
    records[1]["rs_consumer_only_us"] = None
    records[1]["note"] = "rs_consumer_only_us: not captured; "
    geo = moe_report.write_moe(records, 2, str(tmp_path), pending=[("deepseek-v3", 16384, "zipf")])
    assert geo["ag_vs_nccl"] == pytest.approx(3.0) and geo["layer_vs_torch"] == pytest.approx(3.0)
    assert geo["rs_consumer_vs_grouped_mm"] == pytest.approx(90 / 92)  # the record without it left out
    base = os.path.join(tmp_path, "moe-H200x2")
    with open(base + ".md") as f:
        md = f.read()
    assert md.count("| mixtral-8x7b | 4096 | balanced |") == 1 and "| n/a |" in md
    assert "ag_moe_gemm over NCCL + torch._grouped_mm (target >= 1.25x): 3.000" in md
    assert "Not measured in this run (it ended before them): deepseek-v3,16384,zipf." in md
    assert "not captured" in md
    with open(base + ".json") as f:
        doc = json.load(f)
    assert doc["op"] == "moe" and doc["world_size"] == 2 and doc["commit"] and len(doc["records"]) == 2
    assert doc["not_measured"] == [["deepseek-v3", 16384, "zipf"]]
    header_cols = moe_report.MOE_HEADER.splitlines()[0].count("|") - 1
    assert moe_report.moe_row(records[0]).count("|") - 1 == header_cols


def _baseline_and_consumer():
    """torch_moe_layer (the benchmark's NCCL + torch._grouped_mm layer, here gloo) against TPMoE on the same
    parameters, forward and gradients; our grouped GEMM alone (consumer_alone) against torch per expert."""
    import triton_overlap as to
    from triton_overlap.nn import TPMoE
    from triton_overlap.ops.moe_routing import grouped_matmul
    from refs import rand, rel_err

    with to.Context(timeout_s=60) as ctx:
        dev, r = ctx.device, ctx.rank
        K, N, E, topk, tokens = 32, 32 * ctx.world_size, 4, 2, 8
        torch.manual_seed(0)
        moe = TPMoE(K, N, E, topk, ctx=ctx, fallback="always")
        x = rand((tokens, K), torch.bfloat16, dev, "x", r).requires_grad_()
        gy = rand((tokens, K), torch.bfloat16, dev, "gy", r)
        moe(x).backward(gy)
        ours = [x.grad, moe.router.weight.grad, moe.w13.grad, moe.w2.grad]
        x.grad = None
        params = [p.detach().clone().requires_grad_() for p in (moe.router.weight, moe.w13, moe.w2)]
        y = moe_bench.torch_moe_layer(x, *params, topk)
        y.backward(gy)
        errs = [rel_err(y, moe(x))] + [rel_err(a, b) for a, b in zip([x.grad] + [p.grad for p in params], ours)]
        assert max(errs) < 2e-2, errs

        rows = rand((37, K), torch.bfloat16, dev, "rows")
        w = rand((E, K, 24), torch.bfloat16, dev, "w")
        experts = torch.sort(torch.randint(0, E, (37,), generator=torch.Generator().manual_seed(4))).values.to(dev)
        out = torch.full((37, 24), float("nan"), dtype=torch.bfloat16, device=dev)
        ag = to.AllGatherMoEGEMM(ctx)
        moe_bench.consumer_alone(ctx, ag, to.MoEGEMMConfig.defaults(ctx), rows, w, experts.view(-1, 1), out)()
        ctx.check()
        err = rel_err(out, grouped_matmul(rows.double(), experts, w.double()))
        assert err < 1e-2, err
        # as where rows are sent sorted by expert: top-2, the sorted layout (by expert, then pair)
        ids = torch.randint(0, E, (37, 2), generator=torch.Generator().manual_seed(5)).to(dev)
        pairs = torch.argsort(ids.reshape(-1), stable=True)
        out2 = torch.full((74, 24), float("nan"), dtype=torch.bfloat16, device=dev)
        cfg = replace(to.MoEGEMMConfig.defaults(ctx), send_rows=True)
        moe_bench.consumer_alone(ctx, ag, cfg, rows, w, ids, out2)()
        ctx.check()
        err2 = rel_err(out2, grouped_matmul(rows[pairs // 2].double(), ids.reshape(-1)[pairs], w.double()))
        assert err2 < 1e-2, err2
        return errs + [err, err2]


def test_baseline_layer_and_consumer_alone_agree_with_ours(pool):
    if pool.backend != "host" or pool.world != 2:
        pytest.skip("host backend, W = 2: the benchmark itself runs on GPUs")
    pool.run(_baseline_and_consumer)
