"""The consumer kernels alone, this tree's against an older tree's, side by side on one GPU: the persistent GEMM
(plain), the warp-specialized GEMM-RS GEMM (as rank 0 of 2, every wait already satisfied), attention forward and
backward (a world of one). Usage: python dev/ab_kernels.py OLD_PACKAGE_DIR (a copy of the older triton_overlap
package directory, renamed triton_overlap_old)."""
from __future__ import annotations

import importlib
import os
import statistics
import sys
import types

import torch
import triton

import triton_overlap  # noqa: F401 - this tree's package
from triton_overlap.kernels import attention as new_attn
from triton_overlap.kernels import attention_bwd as new_bwd
from triton_overlap.kernels import gemm as new_gemm
from triton_overlap.kernels import gemm_warp_specialized as new_ws
from triton_overlap.ops.config import AllGatherGEMMConfig, AttentionConfig
from triton_overlap.plan import ChunkLayout, cdiv, scatter_tile_order


def load_old(path):
    """The older package under the name triton_overlap_old, without running its __init__ (which registers torch
    custom ops of the same names as this tree's)."""
    pkg = types.ModuleType("triton_overlap_old")
    pkg.__path__ = [path]
    sys.modules["triton_overlap_old"] = pkg
    return (importlib.import_module("triton_overlap_old.ops.common"),
            importlib.import_module("triton_overlap_old.ops.gemm_rs"),
            importlib.import_module("triton_overlap_old.ops.cp_attention"))


class GPU:
    """What the launchers ask of a Context, for one rank of ``world`` on this GPU, with no process group."""

    def __init__(self, world=1, rank=0):
        self.backend, self.world_size, self.rank, self.clock = "cuda", world, rank, 1
        self.device = torch.device("cuda", 0)
        self.err = torch.zeros(8, dtype=torch.int32, device=self.device)
        self.budget = int(30e9)
        self.generation, self.producer_jitter_s = 0, 0.0
        self._units = torch.cuda.get_device_properties(0).multi_processor_count

    def num_compute_units(self):
        return self._units

    def after_launch(self):
        pass

    def on_close(self, fn):
        pass

    def cached(self, key, make):
        return make()


def timed(fn, rounds=5):
    """Median ms of ``fn`` per round (triton.testing.do_bench, median of its repeats)."""
    return [triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") for _ in range(rounds)]


def compare(rows, name, old, new, rounds=5):
    """Old and new in turns, ``rounds`` times each; median of the rounds."""
    o, n = [], []
    for _ in range(rounds):
        o += timed(old, 1)
        n += timed(new, 1)
    mo, mn = statistics.median(o), statistics.median(n)
    rows.append((name, mo * 1e3, mn * 1e3, mn / mo))
    print(f"| {name} | {mo * 1e3:.1f} | {mn * 1e3:.1f} | {mn / mo:.3f} |", flush=True)


def main():
    old_common, old_rs, old_cp = load_old(os.path.abspath(sys.argv[1]))
    ctx = GPU()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| kernel | old µs | new µs | new / old |\n|---|---|---|---|", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg_new = AllGatherGEMMConfig.defaults("cuda")
    cfg_old = old_common.default_config(ctx)
    for M, K, N, wt in ((2048, 4096, 4096, False), (8192, 4096, 4096, False), (8192, 8192, 8192, False),
                        (8192, 8192, 3584, True), (4096, 8192, 1792, True), (16384, 8192, 14336, False)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g).t() if wt
             else torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=g))
        out_o, out_n = torch.empty(M, N, device="cuda", dtype=torch.bfloat16), torch.empty(M, N, device="cuda",
                                                                                         dtype=torch.bfloat16)
        old = old_common.plain_gemm(ctx, cfg_old, a, w, out_o)
        new = new_gemm.plain_gemm(ctx, cfg_new, a, w, out_n)
        old(), new()
        torch.cuda.synchronize()
        assert torch.equal(out_o, out_n), f"{M}x{K}x{N}: the two GEMMs differ"
        compare(rows, f"GEMM {M}x{K}x{N}{' (w = weight.t())' if wt else ''}", old, new)

    # the warp-specialized GEMM-RS GEMM as rank 0 of 2: counters full before each launch (it zeroes them at exit)
    W = 2
    ctx2 = GPU(world=W)
    for M, K, N in ((2048, 4096, 4096), (8192, 4096, 4096), (8192, 1792, 8192)):
        m_local = M // W
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=g)
        layout = ChunkLayout(W, m_local, m_local)
        order = torch.tensor(scatter_tile_order(layout, 0, 128), dtype=torch.int32, device="cuda")
        counts = layout.tile_stores(128, cdiv(N, 256))
        expected = torch.tensor(counts[0], dtype=torch.int32, device="cuda")
        full = torch.tensor([counts[0][0]] * layout.num_chunks, dtype=torch.int32, device="cuda")
        recv = torch.randn(W * m_local, N, device="cuda", dtype=torch.bfloat16, generator=g)
        staging = torch.empty(W, m_local, N, device="cuda", dtype=torch.bfloat16)
        out_o, out_n = torch.empty(m_local, N, device="cuda", dtype=torch.bfloat16), torch.empty(
            m_local, N, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros(layout.num_chunks, dtype=torch.int32, device="cuda")
        done = torch.zeros(layout.num_chunks, dtype=torch.int32, device="cuda")
        ptrs = torch.tensor([recv.data_ptr(), staging[1].data_ptr()], dtype=torch.int64, device="cuda")
        cptrs = torch.tensor([counters.data_ptr(), done.data_ptr() + 4], dtype=torch.int64, device="cuda")
        ticks_o, ticks_n = (torch.zeros(2, dtype=torch.int32, device="cuda") for _ in range(2))
        b_layout = new_ws.layout_for(ctx2, a, w, m_local)
        op_old = old_rs.GEMMReduceScatter(ctx2, old_common.default_config(ctx2))
        cfg = op_old.config.__class__(**{**op_old.config.__dict__, **old_rs.WS_TILES})

        def old_call():
            counters.copy_(full)
            op_old._launch_ws(cfg, b_layout, a, w, recv, out_o, None, layout, order, expected, counters, ptrs, cptrs,
                              ticks_o)

        def new_call():
            counters.copy_(full)
            new_ws.launch_gemm_rs(ctx2, b_layout, a, w, recv, out_n, None, layout, order, expected, counters, ptrs,
                                  cptrs, ticks_n)

        old_call(), new_call()
        torch.cuda.synchronize()
        assert torch.equal(out_o, out_n), f"{M}x{K}x{N}: the two warp-specialized GEMMs differ"
        compare(rows, f"GEMM-RS warp-specialized GEMM {M}x{K}x{N} (rank 0 of 2)", old_call, new_call)

    # attention, a world of one on the full sequence (every flag up)
    for S, causal in ((16384, True), (32768, True), (16384, False)):
        B, Hq, Hkv, D = 1, 32, 8, 128
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        cfg = AttentionConfig.defaults("cuda", D)
        ocfg = old_cp.default_attention_config("cuda", D)
        ones = torch.ones(2, dtype=torch.int32, device="cuda")
        oo, on = torch.empty_like(q), torch.empty_like(q)
        lo, ln = (torch.empty(B, Hq, S, device="cuda", dtype=torch.float32) for _ in range(2))
        scale = D ** -0.5

        def fwd_old():
            old_cp.launch_fwd(q, k, v, k, v, oo, lo, ones, ctx.err, ctx.budget, 0, 1, 0, S // 2, 2, scale, causal,
                              ocfg.fwd, 1, False)

        def fwd_new():
            new_attn.launch_fwd(ctx, q, k, v, k, v, on, ln, ones, S // 2, 2, scale, causal, cfg.fwd, rank=0, world=1)

        fwd_old(), fwd_new()
        torch.cuda.synchronize()
        assert torch.equal(oo, on) and torch.equal(lo, ln), f"S={S}: the two forwards differ"
        compare(rows, f"attention forward S={S // 1024}k {'causal' if causal else 'full'}", fwd_old, fwd_new)
        dout = torch.randn_like(q)
        delta = (dout.float() * on.float()).sum(-1).transpose(1, 2).contiguous()
        parts = [torch.zeros(1, 2, B, S, Hkv, D, device="cuda", dtype=torch.float32) for _ in range(2)]
        cnt = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]
        tabs = [(torch.tensor([p.data_ptr()], dtype=torch.int64, device="cuda"),
                 torch.tensor([c.data_ptr()], dtype=torch.int64, device="cuda")) for p, c in zip(parts, cnt)]
        dqo, dqn = torch.empty_like(q), torch.empty_like(q)

        def bwd_old():
            old_cp.launch_bwd(q, k, v, k, v, dout, ln, delta, dqo, *tabs[0], ones, ctx.err, ctx.budget, 0, 1, 0,
                              S // 2, 2, scale, causal, ocfg, 1, False)

        def bwd_new():
            new_bwd.launch_bwd(ctx, q, k, v, k, v, dout, ln, delta, dqn, *tabs[1], ones, S // 2, 2, scale, causal,
                               cfg.dq, cfg.dkdv, rank=0, world=1)

        bwd_old(), bwd_new()
        torch.cuda.synchronize()
        assert torch.equal(dqo, dqn) and torch.equal(parts[0], parts[1]), f"S={S}: the two backwards differ"
        compare(rows, f"attention backward S={S // 1024}k {'causal' if causal else 'full'}", bwd_old, bwd_new)
    ratios = [r[3] for r in rows]
    print(f"\nnew / old: geometric mean {statistics.geometric_mean(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(rows)} kernels")


if __name__ == "__main__":
    main()
