"""Expert-parallel dispatch and combine on a group that spans hosts: which blocks travel by copy engine or kernel
stores (the ranks of this rank's host, whose memory it maps) and which through the Context's Link (the ranks of
other hosts: the process group's point-to-point, NCCL on GPUs, on a producer stream; producers.link).

Every rank holds every rank's counts once the first exchange is done (ops.expert_parallel, step 2), so both sides of
every exchange between hosts know its sizes without asking: a dispatch's record goes to every remote rank with the
copies of the counts step, a source's block of rows (and metadata) for a remote owner goes straight into the owner's
receive buffer at the same place a copy engine would put it, with the rows step, and a combine's partials for a
remote source are summed into a local staging buffer by the same launch that stores the local sources' partials into
their memory, then sent into the source's partials buffer at the place of its block. Each exchange raises the
receiver's own flag for the sender, so the waits are those of one host. A combine sums the remote sources'
partials first, in a launch of their own, so that they cross while the local sources' are summed.

What does not cross hosts: the dispatch's pushing pack (it stores into the owners' memory before the host has the
counts) and the per-source experts' GEMM (its gather index is stored into the owners' memory the same way); across
hosts a dispatch packs once the counts are on the host and moves the rows by copy engine and Link, and
``d.projected`` is computed after the rows are in (``op.last_gemm`` says "torch").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.row_sums import job_table
from ..plan import send_order
from ..producers import exchange


def remote_ranks(ctx) -> tuple | None:
    """The ranks on other hosts, or None where the group is one host (ExchangeSchedule.remote)."""
    return ctx.topology.remote_ranks(ctx.rank) or None


def counts_remote(remote, table, record: torch.Tensor) -> dict | None:
    """The counts step's exchange with the ``remote`` ranks (producers.exchange.between_hosts): this rank's record
    to each, each one's into its row of this rank's table; None on one host (``remote`` None)."""
    return None if remote is None else {d: ([record], [table.local[d]]) for d in remote}


def rows_remote(remote, r: int, traffic, sent, rows, meta) -> dict | None:
    """The rows step's exchange with the ``remote`` ranks: rank r's block (rows, metadata) for each remote owner,
    and each remote source's block for rank r into the receive buffers at its place (Traffic.recv_offset); None on
    one host."""
    if remote is None:
        return None
    out = {}
    for d in remote:
        a, n = traffic.send_offset(r, d), traffic.rows[r][d]
        b, m = traffic.recv_offset(d, r), traffic.rows[d][r]
        out[d] = ([sent.rows[a:a + n], sent.meta[a:a + n]], [rows.local[b:b + m], meta.local[b:b + m]])
    return out


@dataclass(frozen=True, eq=False)
class CombineJobs:
    """A combine's partials launches (kernels.row_sums.launch_gather_rows_sum_jobs): ``local`` the job table of the
    sources on this host (peers in send order, then this rank; each job: the rows received from it and where they
    go in its partials buffer), ``remote`` that of the sources on other hosts (None on one host), whose partials go
    to a staging buffer (entry W of the addresses ``ptrs``) before they cross: ``staged``, each remote source's rows
    of it; ``local_most`` and ``remote_most`` their largest job's rows."""

    local: torch.Tensor
    local_most: int
    ptrs: torch.Tensor
    remote: torch.Tensor | None = None
    remote_most: int = 0
    staged: dict | None = None


def combine_jobs(ctx, remote, state: dict, d, back) -> CombineJobs:
    """The CombineJobs of dispatch ``d``'s combine into the partials buffer ``back``, ``remote`` the ranks on other
    hosts (or None); made once per dispatch and buffer (a forward's combine and its backward's share them)."""
    key = (back.local.data_ptr(), back.local.shape[1], back.local.dtype)
    cached = state.get("combine jobs")
    if cached is not None and cached[0] is d.traffic and cached[1] == key:
        return cached[2]
    W, r, traffic = ctx.world_size, ctx.rank, d.traffic
    remote, local_jobs, remote_jobs, places, at = set(remote or ()), [], [], {}, 0
    for s in send_order(r, W) + [r]:
        n = traffic.rows[s][r]
        if s in remote:
            remote_jobs.append((W, traffic.recv_offset(s, r), at, n))
            places[s] = (at, n)
            at += n
        else:
            local_jobs.append((s, traffic.recv_offset(s, r), traffic.send_offset(s, r), n))
    ptrs, remote_table, remote_most, staged = back.ptrs, None, 0, None
    if remote:
        stage = torch.empty((max(at, 1), back.local.shape[1]), dtype=back.local.dtype, device=ctx.device)
        staged = {s: stage[a:a + n] for s, (a, n) in places.items()}  # (the views keep the buffer)
        extra = torch.tensor([stage.data_ptr()], dtype=torch.int64).to(ctx.device, non_blocking=True)
        ptrs = torch.cat([back.ptrs, extra])
        remote_table, remote_most = job_table(ctx, remote_jobs), max(n for *_, n in remote_jobs)
    made = CombineJobs(job_table(ctx, local_jobs), max(n for *_, n in local_jobs), ptrs, remote_table, remote_most,
                       staged)
    state["combine jobs"] = (d.traffic, key, made)
    return made


def partials_between_hosts(ctx, remote, d, back, staged: dict, flags, op: int):
    """After the remote sources' partials launch on the caller's stream: on a producer stream, the ``staged``
    partials (CombineJobs.staged) to each remote source and each remote owner's partials for this rank into
    ``back`` at its block (Traffic.send_offset), with this rank's flag for each. Returns that stream (the caller's
    waits for it before its wait for the flags)."""
    r, traffic = ctx.rank, d.traffic
    blocks = {}
    for o in remote:
        a, n = traffic.send_offset(r, o), traffic.rows[r][o]
        blocks[o] = ([staged[o]], [back.local[a:a + n]])
    stream = ctx.streams(1)[0]
    stream.wait_stream(ctx.current_stream())
    exchange.between_hosts(ctx, stream, blocks, flags, f"ep_combine partials with ranks {list(remote)}", op)
    return stream


__all__ = ["CombineJobs", "combine_jobs", "counts_remote", "partials_between_hosts", "remote_ranks", "rows_remote"]
