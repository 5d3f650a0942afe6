"""Tutorial 04: context-parallel attention, K/V gathered by copy engines while the kernel already computes.

    bash scripts/launch.sh tutorials/04_context_parallel_attention.py

Long sequences are split over ranks. With causal attention a plain split is
unbalanced (the last rank's queries see the most keys), so the sequence is cut
into 2W chunks and rank r keeps chunks r and 2W-1-r: ``zigzag.shard`` does this,
``zigzag.unshard`` undoes it. Each rank then needs every rank's K and V.

``ContextParallelAttention`` has copy engines push this rank's K/V to every
peer chunk by chunk, each chunk followed by a flag, while one flash-attention
kernel folds in its own K/V first and each peer's chunk as its flag rises.
Blocks above the causal diagonal (using global positions) are never waited
for. It returns ``lse`` too, and it is differentiable: backward sends the
partial dK/dV of every chunk back to its owner, where they are summed.

Packed documents: pass ``cu_seqlens`` (the documents' boundaries in the full
sequence). Every document is cut into 2W chunks on its own, each rank holds
its two chunks of every document (``zigzag.shard(x, ctx, cu_seqlens=...)``), and
a query attends to its own document only.
"""
import math

import torch
import torch.distributed as dist

import triton_overlap as to
from triton_overlap.torchrun import backend_name, init, say, verdict


def full_attention(q, k, v):
    """The reference: causal attention on the whole sequence, float32, GQA by repeating K/V heads."""
    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


def main():
    device = init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W = ctx.world_size
        gpu = ctx.backend != "host"
        B, S, Hq, Hkv, D = (1, 8192, 32, 8, 128) if gpu else (1, 24 * W, 4, 2, 64)
        say(f"{ctx}: B={B}, S={S} in total ({S // W} per rank), Hq={Hq}, Hkv={Hkv}, D={D}, causal")

        # %% The full sequence, the same on every rank (seeded), and this rank's zigzag shard of it.
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, S, h, D, generator=g).to(device, torch.bfloat16) for h in (Hq, Hkv, Hkv))
        dout = torch.randn(B, S, Hq, D, generator=g).to(device, torch.bfloat16)
        qs, ks, vs = (to.zigzag.shard(t, ctx).requires_grad_() for t in (q, k, v))
        say(f"rank 0 holds positions {to.zigzag.positions(0, W, S // W)[:3].tolist()}... and "
            f"...{to.zigzag.positions(0, W, S // W)[-3:].tolist()}")

        # %% Forward and backward through the op.
        attn = to.ContextParallelAttention(ctx)
        out, lse = attn(qs, ks, vs, causal=True)
        out.backward(to.zigzag.shard(dout, ctx))
        ctx.check()

        # %% Verdict against full-sequence attention (forward and gradients) in float32.
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref = full_attention(*leaves)
        ref.backward(dout.float())
        errs = {"out": to.zigzag.unshard(out.detach(), ctx), "dq": to.zigzag.unshard(qs.grad, ctx),
                "dk": to.zigzag.unshard(ks.grad, ctx), "dv": to.zigzag.unshard(vs.grad, ctx)}
        want = {"out": ref.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
        errs = {n: float((t.float() - want[n]).norm() / want[n].norm()) for n, t in errs.items()}
        say("relative errors: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()) + " (tolerance 2e-2 for bf16)")

        # %% Packed documents: three documents of different lengths (each a multiple of 2W) in one sequence.
        unit = 2 * W * (S // (2 * W) // 8)
        cu = [0, 3 * unit, 4 * unit, S]
        qd, kd, vd = (to.zigzag.shard(t, ctx, cu_seqlens=cu) for t in (q, k, v))
        with torch.no_grad():
            out_docs, _ = attn(qd, kd, vd, causal=True, cu_seqlens=cu)
        ctx.check()
        got = to.zigzag.unshard(out_docs, ctx, cu_seqlens=cu)
        ref_docs = torch.cat([full_attention(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in zip(cu[:-1], cu[1:])], 1)
        errs["out, packed documents"] = float((got.float() - ref_docs).norm() / ref_docs.norm())
        say(f"packed documents at {cu}: out relative error {errs['out, packed documents']:.2e}")

        # %% On GPUs, the time beside NCCL all_gather of K/V followed by the same kernel (no overlap).
        if gpu:
            from triton_overlap.context.collectives import all_gather_rows
            from triton_overlap.ops.attention_on_gathered import forward_on_gathered
            from triton_overlap.timing import time_dist

            k0, v0, q0 = ks.detach(), vs.detach(), qs.detach()
            kg = torch.empty(W * B, S // W, Hkv, D, device=device, dtype=k0.dtype)  # B = 1: the workspace layout
            vg = torch.empty_like(kg)
            o2, l2 = torch.empty_like(out), torch.empty_like(lse)
            cfg = attn.config_for(attn.shape_key(q0, k0, True))

            def nccl():
                all_gather_rows(kg, k0)
                all_gather_rows(vg, v0)
                forward_on_gathered(ctx, q0, k0, v0, kg.view(B, -1, Hkv, D), vg.view(B, -1, Hkv, D), ctx.rank, W,
                                    True, 1 / math.sqrt(D), cfg, out=o2, lse=l2)

            with torch.no_grad():
                ours = time_dist(lambda: attn(qs.detach(), k0, v0, causal=True), 10)
            base = time_dist(nccl, 10)
            say(f"forward: ours {ours:.1f} µs, NCCL all_gather + the same kernel {base:.1f} µs ({base / ours:.2f}x)")
        if not verdict(max(errs.values()) < 2e-2, "forward and gradients within tolerance"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
