"""Tutorial 10: expert parallelism: each rank owns whole experts, tokens travel to them and back.

    bash scripts/launch.sh tutorials/10_expert_parallel_moe.py

Tensor-parallel MoE (tutorial 08) gives every rank a slice of every expert. Expert-parallel MoE gives rank r whole
experts ``[r*E/W, (r+1)*E/W)``, and moves tokens instead of activations' slices:

* ``to.ep_dispatch(x, topk_ids, topk_weights, num_experts=E, ctx=ctx)`` sends each of this rank's tokens
  ``x`` [T_local, D] once to every rank that owns one of its top-k experts (a kernel stores them straight into the
  owner's symmetric receive buffer, a flag per source; copy engines move them on a call whose buffers had to grow)
  and returns a handle whose ``tokens`` are the rows this rank's experts must process, grouped by local expert
  (``counts`` [E/W]; ``offsets`` [E/W + 1] from 0: ``torch._grouped_mm``'s ``offs`` are ``offsets[1:]``);
* ``to.ep_combine(y, handle, ctx=ctx)`` sends the experts' outputs back and returns, on each token's own rank,
  ``sum_j topk_weights[t, j] * y_row(t, j)``, summed in float32 in a fixed order.

A dispatch reads its counts back to the host once (the host sizes the output), so it is not captured in CUDA graphs;
a combine never waits on the host. ``nn.EPMoE.from_full(router, (w1, w3, w2), ctx, topk=...)`` is the layer: the
replicated router, this rank's SwiGLU experts, dispatch and combine with autograd through both; it takes this rank's
own tokens ``[T_local, dim]`` (or ``[S, *, dim]``, flattened in order) and returns the same shape.

This tutorial runs the ops on random routing, with a per-expert scale standing for the experts, against the same
sum computed locally; then the layer's output and gradients against the unsharded MoE of tutorial 08's form.
``bench.py ep`` times both against ``all_to_all_single``.
"""
import torch
import torch.distributed as dist
from torch import nn

import triton_overlap as to
from triton_overlap.nn import EPMoE
from triton_overlap.torchrun import backend_name, init, say, verdict


class MoE(nn.Module):
    """The single-process layer (tutorial 08's): router [E, dim]; gate ``w1`` and up ``w3`` [E, hidden, dim], down
    ``w2`` [E, dim, hidden]. Rows [T, dim] in and out."""

    def __init__(self, dim, hidden, E, topk):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(dim, E, bias=False)
        self.w1, self.w3 = (nn.Parameter(torch.randn(E, hidden, dim) * dim ** -0.5) for _ in range(2))
        self.w2 = nn.Parameter(torch.randn(E, dim, hidden) * hidden ** -0.5)

    def forward(self, x):
        weights, ids = torch.softmax(self.router(x), dim=-1).topk(self.topk, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, j = (ids == e).nonzero(as_tuple=True)
            h = nn.functional.silu(x[tok] @ self.w1[e].t()) * (x[tok] @ self.w3[e].t())
            out = out.index_add(0, tok, weights[tok, j].unsqueeze(1) * (h @ self.w2[e].t()))
        return out


def inputs(q, T, dim, E, topk, device):
    """Rank q's tokens [T, dim], top-k ids and weights (random routing) and output gradient: seeded by q, so every
    rank can rebuild any rank's for the reference."""
    g = torch.Generator().manual_seed(1 + q)
    x = torch.randn(T, dim, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(topk, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(T, topk, generator=g), dim=-1).to(device)
    return x, ids, weights, torch.randn(T, dim, generator=g).to(device)


def main():
    device = init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W, r = ctx.world_size, ctx.rank
        gpu = ctx.backend != "host"
        T, dim, hidden, E, topk = (4096, 2048, 768, 16 * W, 4) if gpu else (12, 32, 24, 4 * W, 2)
        tokens = [T if gpu else T + q for q in range(W)]  # on the host backend the ranks' token counts differ
        say(f"{ctx}: {E} experts, {E // W} per rank, top-{topk}, dim={dim}; tokens per rank {tokens}")
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731

        # %% The ops. Each rank routes its own tokens. "Expert" e scales its rows by e + 1, so the combined output
        # is known locally: out[t] = sum_j w[t, j] * (ids[t, j] + 1) * x[t].
        x, ids, weights, gy = inputs(r, tokens[r], dim, E, topk, device)
        d = to.ep_dispatch(x, ids, weights, num_experts=E, ctx=ctx)
        first = r * (E // W)
        scale = torch.repeat_interleave(torch.arange(first + 1, first + E // W + 1, device=device),
                                        d.counts.long(), output_size=d.num_rows)  # each received row's expert + 1
        out = to.ep_combine(d.tokens * scale.unsqueeze(1).to(d.tokens.dtype), d, ctx=ctx)
        ref = (weights * (ids + 1)).sum(-1, keepdim=True) * x.float()
        err_ops = rel(out, ref)
        say(f"dispatch: rank 0 received {d.num_rows} rows for its {E // W} experts ({d.counts.tolist()}); combine: "
            f"relative error {err_ops:.1e}")

        # %% The layer: rank r copies only its experts from the unsharded MoE (parameters rounded to bf16 first,
        # so both start equal). fallback="never" keeps the overlapped path on the host backend too.
        torch.manual_seed(0)
        full = MoE(dim, hidden, E, topk)
        with torch.no_grad():
            for p in full.parameters():
                p.copy_(p.bfloat16().float())
        moe = EPMoE.from_full(full.router, (full.w1, full.w3, full.w2), ctx, topk=topk, dtype=torch.bfloat16,
                              fallback="auto" if gpu else "never")
        full.to(device)
        xl = x.clone().requires_grad_()
        y = moe(xl)
        y.float().backward(gy)
        # The reference runs every rank's tokens: an owner's expert gradients sum the tokens of all ranks.
        x_refs, y_ref = [], None
        for q in range(W):
            xq, _, _, gq = inputs(q, tokens[q], dim, E, topk, device)
            x_refs.append(xq.float().requires_grad_())
            out_q = full(x_refs[-1])
            out_q.backward(gq)
            y_ref = out_q.detach() if q == r else y_ref
        mine = slice(*moe.expert_range)
        errs = {"output": rel(y.detach(), y_ref), "grad x": rel(xl.grad, x_refs[r].grad),
                "grad w1|w3": rel(moe.w13.grad, torch.cat([full.w1.grad[mine], full.w3.grad[mine]], dim=1).mT),
                "grad w2": rel(moe.w2.grad, full.w2.grad[mine].mT)}
        say("layer, relative errors against float32: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            + f"; path {moe.last_path}")
        ctx.check()
        overlapped = moe.last_path == "overlap" or W == 1  # one rank has nothing to exchange: the process group
        if not verdict(err_ops < 1e-2 and all(v < 4e-2 for v in errs.values()) and overlapped,
                       "dispatch and combine return the local sum, and the EP MoE layer matches, output and gradients"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
