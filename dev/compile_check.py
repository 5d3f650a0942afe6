"""Compile the GEMM kernel's variants, the warp-specialized GEMM-RS kernel and the AllGather GEMM (Gluon), decode's
local product, the attention kernels (the Gluon forward and backward among them), the AllReduce, the fused GEMM +
AllReduce, the MoE grouped GEMMs (the Gluon ones among them), routing and row kernels and the timing spin for a GPU
target without a GPU: Triton's front end, LLVM and ptxas, as a launch on the device would.
Catches compile errors before device time is spent, and prints registers, spills and whether ptxas serialised the
wgmma pipeline (warnings C7514, C7515).

    python3 dev/compile_check.py [--arch 90] [--quick]     (with the package installed)

Run it with each Triton the project supports (the device's, and the newest).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_overlap.kernels.all_reduce import one_shot_all_reduce, two_shot_all_reduce
from triton_overlap.kernels.all_reduce_rmsnorm import one_shot_all_reduce_rmsnorm, one_shot_all_reduce_rmsnorm_flags
from triton_overlap.kernels.attention import cp_attention_fwd
from triton_overlap.kernels.attention_bwd import cp_attention_dkdv, cp_attention_dq
from triton_overlap.kernels.gemm import gather_gemm, persistent_gemm, scatter_gemm
from triton_overlap.kernels.gemm_all_reduce import gemm_all_reduce
from triton_overlap.kernels.signal import (ERR_WORDS, barrier_kernel, remote_header_kernel, remote_status_kernel,
                                           spin_kernel, wait_kernel)

PTRS = ("a_ptr", "ws_ptr", "b_ptr", "c_ptr", "bias_ptr", "out_ptr")
I32_PTRS = ("tile_order_ptr", "flags_ptr", "err_ptr", "expected_ptr", "tick_ptr")
#: a kernel's ``waiter`` (kernels.signal.waiter): the error word, the budget, the rank, the op
WAITER = ("*i32", "i64", "i32", "i32")


def divisibility(sig: dict, skip=("rank", "op", "world", "split_m", "own_plane", "ws_plane", "own_shift",
                                  "budget")) -> dict:
    """What Triton's launcher would assume of the issue shapes: pointers and integer arguments divisible by 16 (of a
    waiter, its error word only)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if not isinstance(ty, tuple) and (ty.startswith("*") or ty == "i32") and name not in skip}
    attrs.update({(i, 0): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty == WAITER})
    return attrs


def gemm_signature(fn, desc: bool, bm: int, bn: int, bk: int, b_kmajor: bool, gather: bool = False,
                   desc_c: bool = False) -> dict:
    sig = {}
    for prm in fn.params:
        name = prm.name
        if prm.is_constexpr:
            sig[name] = "constexpr"
        elif name in PTRS:
            sig[name] = "*bf16"
        elif name in I32_PTRS:
            sig[name] = "*i32"
        elif name in ("scatter_ptrs", "counter_ptrs"):
            sig[name] = "*i64"
        elif name in ("scale_a_ptr", "scale_b_ptr"):
            sig[name] = "*fp32"
        elif name == "waiter":
            sig[name] = WAITER
        elif name == "a_desc":
            sig[name] = (f"tensordesc<bf16[1, {bm}, {bk}]>" if gather else f"tensordesc<bf16[{bm}, {bk}]>") \
                if desc else "constexpr"
        elif name == "c_desc":
            sig[name] = f"tensordesc<bf16[{bm}, {bn // 2}]>" if desc_c else "constexpr"
        elif name == "b_desc":
            sig[name] = (f"tensordesc<bf16[{bn}, {bk}]>" if b_kmajor else f"tensordesc<bf16[{bk}, {bn}]>") \
                if desc else "constexpr"
        else:
            sig[name] = "i32"
    return sig


def attention_signature(fn) -> dict:
    """The attention kernels' arguments as the op passes them (bf16 tensors, float32 lse/delta, int32 flags and
    tables, int64 address tables)."""
    sig = {}
    for prm in fn.params:
        name = prm.name
        if prm.is_constexpr:
            sig[name] = "constexpr"
        elif name in ("lse_ptr", "delta_ptr", "part_ptr"):
            sig[name] = "*fp32"
        elif name in ("flags_ptr", "err_ptr", "seg_ptr", "cu_ptr", "ticket_ptr", "dq_acc_ptr"):
            sig[name] = "*i32"
        elif name in ("recv_ptrs", "counter_ptrs"):
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name == "waiter":
            sig[name] = WAITER
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def collective_signature(fn, data: tuple, dtype: str) -> dict:
    """The arguments of a kernel over symmetric slots (the AllReduces, the fused GEMM + AllReduce) as their ops pass
    them: ``data`` pointers of ``dtype``, int64 address tables (``*_ptrs``), int32 flags, headers and counters, an
    int64 budget, int32 scalars."""
    return {prm.name: "constexpr" if prm.is_constexpr else f"*{dtype}" if prm.name in data
            else "*i64" if prm.name.endswith("_ptrs")
            else "*i32" if prm.name.endswith("_ptr") or prm.name.startswith("local_")
            else WAITER if prm.name == "waiter" else "i32" for prm in fn.params}


def compile_signals(target) -> int:
    """The barrier (with the call headers), a bare wait, the comparison of headers from other hosts and the check of
    the error words they send, as the Context launches them; the one-shot AllReduce."""
    failed = 0
    for fn, consts in ((barrier_kernel, dict(BLOCK_W=8, CLOCK=1)), (wait_kernel, dict(CLOCK=1)),
                       (remote_header_kernel, {}), (remote_status_kernel, dict(N_WORDS=ERR_WORDS))):
        sig = {}
        for prm in fn.params:
            n = prm.name
            sig[n] = ("constexpr" if prm.is_constexpr else "*i64" if n in ("peer_slots_ptr", "header_ptrs")
                      else "*i32" if n.endswith("_ptr") else "i64" if n == "budget" else "i32")
        failed += compile_one(target, fn.fn.__name__, ASTSource(fn=fn, signature=sig, constexprs=consts),
                              {"num_warps": 1})
    tagged = dict(local_words="*i64", local_header="*i64")  # the tagged exchange's slots and headers
    for fn, dtype in itertools.product((one_shot_all_reduce, two_shot_all_reduce), ("bf16", "fp32")):  # AllReduce
        sig = collective_signature(fn, ("x_ptr", "out_ptr", "local_data"), dtype)
        consts = dict(BLOCK=1024, BLOCK_W=8, CLOCK=1)
        if fn is one_shot_all_reduce:
            sig.update(tagged)
            consts.update(PACK=2 if dtype == "bf16" else 1, ONE_PROGRAM=dtype == "bf16", WORD_IO=dtype == "bf16")
        failed += compile_one(target, f"{fn.fn.__name__} {dtype}", ASTSource(fn=fn, signature=sig, constexprs=consts),
                              {"num_warps": 4})
    for fn, out, fp8_max, word_io in itertools.product(
            (one_shot_all_reduce_rmsnorm, one_shot_all_reduce_rmsnorm_flags), ("*bf16", "*fp8e4nv"), (0.0, 448.0),
            (True, False)):  # AllReduce + residual + RMSNorm: 16-bit or fp8 out, 32-bit loads and stores or 16-bit ones
        if (out == "*fp8e4nv") != (fp8_max > 0):
            continue
        sig = collective_signature(fn, ("x_ptr", "residual_ptr", "weight_ptr", "residual_out_ptr", "local_data"),
                                   "bf16")
        sig.update(out_ptr=out, scale_ptr="*fp32", eps="fp32")
        consts = dict(BLOCK=8192, PACK=2, WORD_IO=word_io, BLOCK_W=8, CLOCK=1, FP8_MAX=fp8_max)
        if fn is one_shot_all_reduce_rmsnorm:
            sig.update(tagged)
            consts["ONE_PROGRAM"] = False
        failed += compile_one(target, f"{fn.fn.__name__} out {out[1:]} word_io {word_io}", ASTSource(
            fn=fn, signature=sig, constexprs=consts), {"num_warps": 16})
    return failed


def compile_gemm_all_reduce(target) -> int:
    """The fused GEMM + AllReduce at the GPU defaults' tiles (ops.config.GEMMAllReduceConfig), with and without
    the bias, B as [K, N] or as a transpose (stride 1 along K); tiles of at most SWAP_MAX_ROWS rows swapped, as
    the op launches them."""
    from triton_overlap.ops.config import GEMMAllReduceConfig
    from triton_overlap.ops.gemm_all_reduce import SWAP_MAX_ROWS

    gpu = types.SimpleNamespace(backend="cuda", interpreted=False,  # what the defaults read of a Context (sm_90's)
                                shared_memory_per_program=lambda: 227 << 10)
    failed = 0
    for m, bias, kmajor in itertools.product((1, 128, 4096), (False, True), (False, True)):
        cfg = GEMMAllReduceConfig.defaults(gpu, m, 4096, 132)
        sig = collective_signature(gemm_all_reduce, ("a_ptr", "b_ptr", "bias_ptr", "out_ptr", "local_data"), "bf16")
        unit = "stride_bk" if kmajor else "stride_bn"
        sig[unit] = sig["stride_ak"] = "constexpr"  # 1 at every launch: Triton specialises it as a constant
        consts = {unit: 1, "stride_ak": 1, "HAS_BIAS": bias, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_K": cfg.block_k, "BLOCK_W": 8, "EVEN_K": True, "DOT_F32": False, "CLOCK": 1,
                  "SWAP_AB": cfg.block_m <= SWAP_MAX_ROWS}
        name = f"gemm_all_reduce M={m} tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k} bias={bias} b_kmajor={kmajor}"
        failed += compile_one(target, name, ASTSource(
            fn=gemm_all_reduce, signature=sig, constexprs=consts,
            attrs=divisibility(sig, skip=("rank", "op", "world", "budget", "M"))),
            {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return failed


def compile_skinny_gemm(target) -> int:
    """Decode's local product (kernels.skinny_gemm) as skinny_linear launches it, with and without the bias."""
    from triton_overlap.kernels import skinny_gemm as sg

    failed = 0
    for bias in (False, True):
        sig = {p.name: ("constexpr" if p.is_constexpr else "*bf16" if p.name.endswith("_ptr") else "i32")
               for p in sg.skinny_gemm.params}
        consts = dict(BLOCK_N=sg.BLOCK_N, BLOCK_M=sg.MAX_ROWS, BLOCK_K=sg.BLOCK_K, HAS_BIAS=bias)
        failed += compile_one(target, f"skinny_gemm bias={bias}", ASTSource(
            fn=sg.skinny_gemm, signature=sig, constexprs=consts, attrs=divisibility(sig, skip=("M",))),
            {"num_warps": sg.WARPS, "num_stages": sg.STAGES})
    return failed


def compile_attention(target) -> int:
    """The forward, dQ and dK/dV kernels, dense and packed (VARLEN), causal and not, with the H200 tiles; the
    dK/dV kernel also with its query heads split over two programs."""
    failed = 0
    tiles = {cp_attention_fwd: (128, 64, 8, 3), cp_attention_dq: (128, 64, 8, 2), cp_attention_dkdv: (64, 128, 8, 2)}
    for fn, (bm, bn, warps, stages) in tiles.items():
        splits = (1, 2) if fn is cp_attention_dkdv else (None, )
        for varlen, causal, split in itertools.product((False, True), (True, False), splits):
            name = f"{fn.fn.__name__} varlen={varlen} causal={causal}" + (f" split={split}" if split else "")
            consts = dict(CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_D=128, CLOCK=1, DOT_F32=False, VARLEN=varlen)
            if split:
                consts.update(SPLIT=split, DQ_ACC=False)  # DQ_ACC: the host backend's single pass only
            try:
                sig = attention_signature(fn)
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=divisibility(sig)),
                                   target=target, options={"num_warps": warps, "num_stages": stages})
                print(f"{name}: {ptxas_report(k.asm['ptx'], target.arch)}, shared {k.metadata.shared} B")
            except Exception as e:  # noqa: BLE001 - reported, the check goes on
                failed += 1
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[-600:]}")
    return failed


def gluon_desc_type(target, block, float32=False) -> str:
    """What Triton's launcher makes of a Gluon TMA descriptor of bf16 (or float32) with this block, for a kernel's
    signature."""
    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import native_specialize_impl

    if len(block) == 1:  # float32 rows (the attention backward's lse and delta)
        from triton_overlap.kernels.attention_bwd_hopper import ROWS_LAYOUT

        d = TensorDescriptor(torch.empty(4096), [4096], [1], block, ROWS_LAYOUT)
    else:
        dt, gdt = (torch.float32, gl.float32) if float32 else (torch.bfloat16, gl.bfloat16)
        t = torch.empty(*[2] * (len(block) - 2), 256, 256, dtype=dt)  # 3-D: a [1, rows, cols] block of planes
        d = TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))
    return native_specialize_impl(CUDABackend(target), d, False, True, True)[0]


def compile_one(target, name, src, options) -> int:
    """Compile Triton source ``src`` (an ASTSource); print its ptxas figures and shared memory, or the end of the
    error. Returns 1 if it failed, else 0."""
    try:
        k = triton.compile(src, target=target, options=options)
        print(f"{name}: {ptxas_report(k.asm['ptx'], target.arch)}, shared {k.metadata.shared} B")
        return 0
    except Exception as e:  # noqa: BLE001 - reported, the check goes on
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[-600:]}")
        return 1


def compile_gluon(target, name, fn, sig, consts, options, tail) -> int:
    """Compile Gluon kernel ``fn`` with this signature and constants; print its ptxas figures and shared memory, or
    the last ``tail`` characters of the error. Returns 1 if it failed, else 0."""
    from triton.experimental.gluon._runtime import GluonASTSource

    try:
        k = triton.compile(GluonASTSource(fn, sig, consts, divisibility(sig)), target=target, options=options)
        print(f"{name}: {ptxas_report(k.asm['ptx'], target.arch)}, shared {k.metadata.shared} B")
        return 0
    except Exception as e:  # noqa: BLE001 - reported, the check goes on
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[-tail:]}")
        return 1


def compile_warp_specialized(target, quick: bool = False) -> int:
    """kernels.gemm_warp_specialized (Gluon; sm_90 only), as GEMM-RS launches it: B as [K, N] and as [N, K], with
    and without bias, the copy and the store variant; and as plain_gemm_ws does (no TMA preload, B as [N, K])
    (``quick``: B as [K, N] with bias, the copy variant)."""
    if target.arch != 90:
        return 0
    from triton_overlap.kernels import gemm_warp_specialized as ws
    from triton_overlap.kernels.gemm_warp_specialized import rs_gemm_ws

    bm, bn, bk = ws.TILES.block_m, ws.TILES.block_n, ws.TILES.block_k
    desc_type = functools.partial(gluon_desc_type, target)

    failed = 0
    # (B_KMAJOR, HAS_BIAS, PRELOAD_TMA, PEER_STORES)
    cases = [(b_kmajor, bias, True, peer) for b_kmajor, bias, peer
             in itertools.product((False, True), (False, True), (False, True))]
    cases += [(False, False, False, False), (False, True, False, True), (True, False, False, False),
              (True, True, False, False)]
    cases = [(False, True, True, False)] if quick else cases
    for b_kmajor, bias, preload_tma, peer_stores in cases:
        consts = dict(BLOCK_N=bn, GROUP_M=8, NUM_PROGRAMS=131, NUM_STAGES=ws.TILES.num_stages, B_KMAJOR=b_kmajor,
                      HAS_BIAS=bias, CLOCK=1, ALIGN_C=True, EPILOGUE_WARPS=ws.EPILOGUE_WARPS,
                      EPILOGUE_REGS=ws.EPILOGUE_REGS, SUB_M=ws.SUB_M, RESET_AT_EXIT=True,
                      PRELOAD_TMA=preload_tma, PEER_STORES=peer_stores)
        sig = {}
        for prm in rs_gemm_ws.params:
            n = prm.name
            sig[n] = ("constexpr" if n in consts else desc_type([bm, bk]) if n == "a_desc"
                      else desc_type([bn, bk] if b_kmajor else [bk, bn]) if n == "b_desc"
                      else desc_type([bm, bn]) if n == "c_desc"
                      else "*bf16" if n in ("c_ptr", "out_ptr", "bias_ptr")
                      else "*i64" if n in ("scatter_ptrs", "counter_ptrs", "start_ptrs")
                      else "*i32" if n.endswith("_ptr")
                      else WAITER if n == "waiter" else "i32")
        name = (f"rs_gemm_ws b_kmajor={b_kmajor} bias={bias}" + ("" if preload_tma else " preload by loads")
                + (" peer stores" if peer_stores else ""))
        failed += compile_gluon(target, name, rs_gemm_ws, sig, consts, {"num_warps": 8, "maxnreg": ws.MAXNREG}, 600)
    return failed


def compile_gather_hopper(target, quick: bool = False) -> int:
    """kernels.gemm_gather_hopper (Gluon; sm_90 only) as AllGather-GEMM launches it: B as [K, N] and as [N, K],
    with and without bias (``quick``: B as [N, K] with bias)."""
    if target.arch != 90:
        return 0
    from triton_overlap.kernels import gemm_gather_hopper as gh

    bm, bn, bk = gh.TILES.block_m, gh.TILES.block_n, gh.TILES.block_k
    desc_type = functools.partial(gluon_desc_type, target)
    failed = 0
    cases = [(True, True)] if quick else list(itertools.product((False, True), (False, True)))
    for b_kmajor, bias in cases:
        consts = dict(BLOCK_N=bn, GROUP_M=8, NUM_PROGRAMS=131, NUM_STAGES=gh.TILES.num_stages, B_KMAJOR=b_kmajor,
                      HAS_BIAS=bias, CLOCK=1, ALIGN_C=True, STORE_WARPS=gh.STORE_WARPS, STORE_REGS=gh.STORE_REGS,
                      SUB_M=gh.SUB_M, RESET_AT_EXIT=True)
        sig = {}
        for prm in gh.ag_gemm_hopper.params:
            n = prm.name
            sig[n] = ("constexpr" if n in consts else desc_type([1, bm, bk]) if n == "a_desc"
                      else desc_type([bn, bk] if b_kmajor else [bk, bn]) if n == "b_desc"
                      else "*bf16" if n in ("c_ptr", "bias_ptr") else "*i32" if n.endswith("_ptr")
                      else WAITER if n == "waiter" else "i32")
        name = f"ag_gemm_hopper b_kmajor={b_kmajor} bias={bias}"
        failed += compile_gluon(target, name, gh.ag_gemm_hopper, sig, consts, {"num_warps": 8, "maxnreg": gh.MAXNREG},
                                1500)
    return failed


def compile_attention_ws(target, quick: bool = False) -> int:
    """kernels.attention_hopper (Gluon; sm_90 only) as the op launches it: causal or not, D = 64 and 128, each
    (block_n, stages, compute warpgroups) the tuned table may name (``quick``: the shipped blocks, causal, and not
    causal with the split tail), and merge_parts."""
    if target.arch != 90:
        return 0
    from triton_overlap.kernels import attention_hopper as ah

    desc_type = functools.partial(gluon_desc_type, target)

    failed = 0
    cases = ([(True, 128, 128, 2, 2), (False, 128, 128, 2, 2), (True, 64, 128, 3, 3), (False, 64, 128, 3, 3)]
             if quick else itertools.product((True, False), (128, 64), (128, 64), (2, 3), (2, 3)))
    for causal, d, bn, stages, nwg in cases:
        if d * bn * stages * 4 + 128 * d * 2 > 200 * 1024 or (nwg == 3 and d != 64):
            continue
        consts = dict(CAUSAL=causal, STAGES=stages, CLOCK=1, COMPUTE_REGS=ah.COMPUTE_REGS[nwg], SPLIT=not causal,
                      NWG=nwg, Q_REGS=ah.q_in_registers(causal, d, nwg))
        sig = {}
        for prm in ah.cp_attention_fwd_ws.params:
            n = prm.name
            sig[n] = ("constexpr" if n in consts else desc_type([64, d]) if n in ("q_desc", "o_desc", "p_desc")
                      else desc_type([bn, d]) if n.endswith("_desc")
                      else "*bf16" if n == "o_ptr" else "*fp32" if n in ("lse_ptr", "part_lse_ptr")
                      else "*i32" if n.endswith("_ptr") else WAITER if n == "waiter"
                      else "fp32" if n == "sm_scale" else "i32")
        name = f"cp_attention_fwd_ws causal={causal} D={d} block_n={bn} stages={stages} warp groups={nwg}"
        failed += compile_gluon(target, name, ah.cp_attention_fwd_ws, sig, consts, {"num_warps": 4}, 900)
    for d, bm in ((64, 192), (128, 128)):  # the split tiles' merge (plain Triton)
        consts = dict(BLOCK_M=bm, ROWS=64, HEAD_D=d)
        sig = {prm.name: "constexpr" if prm.name in consts else "*bf16" if prm.name in ("out_ptr", "part_o_ptr")
               else "*fp32" if prm.name.endswith("_ptr") else "i32" for prm in ah.merge_parts.params}
        src = ASTSource(fn=ah.merge_parts, signature=sig, constexprs=consts)
        triton.compile(src, target=target, options={"num_warps": 4})
        print(f"merge_parts D={d}: compiled")
    return failed


def compile_attention_bwd_ws(target, quick: bool = False) -> int:
    """kernels.attention_bwd_hopper (Gluon; sm_90 only) as launch_bwd launches it: causal or not, D = 64 and 128,
    the query heads whole or split (``quick``: D = 128 causal, split in two)."""
    if target.arch != 90:
        return 0
    from triton_overlap.kernels import attention_bwd_hopper as ab

    desc_type = functools.partial(gluon_desc_type, target)
    failed = 0
    cases = ((True, 128, 2),) if quick else ((True, 128, 1), (False, 128, 1), (True, 64, 1), (False, 64, 1),
                                             (True, 128, 4))
    for causal, d, split in cases:
        bm, stages = ab.tiles(d)
        consts = dict(CAUSAL=causal, SPLIT=split, INTERLEAVE=4, NSTAGE=stages, CLOCK=1, COMPUTE_REGS=ab.COMPUTE_REGS)
        sig = {}
        for prm in ab.cp_attention_bwd_ws.params:
            n = prm.name
            sig[n] = ("constexpr" if n in consts else desc_type([bm, d]) if n in ("q_desc", "do_desc")
                      else desc_type([bm]) if n in ("lse_desc", "delta_desc")
                      else desc_type([bm, d // 2], float32=True) if n == "dq_desc"
                      else desc_type([ab.BLOCK_N, d]) if n.endswith("_desc")
                      else "*i64" if n in ("recv_ptrs", "counter_ptrs") else "*fp32" if n == "part_ptr"
                      else "*i32" if n.endswith("_ptr") else WAITER if n == "waiter"
                      else "fp32" if n == "sm_scale" else "i32")
        name = f"cp_attention_bwd_ws causal={causal} D={d} split={split} block_m={bm}"
        failed += compile_gluon(target, name, ab.cp_attention_bwd_ws, sig, consts, {"num_warps": 4}, 1500)
    return failed


def compile_grouped_gemm(target, quick: bool = False) -> int:
    """kernels.grouped_gemm (plain Triton: the tensor-parallel MoE ops' consumers) at the GPU defaults' tiles
    (ops.moe_config.MoEGEMMConfig), bf16, as the ops launch them: B through pointers, and through a descriptor of a
    transposed weight (B_DESC 2, with ``tma=True``; ``quick``: pointers only)."""
    from triton_overlap.kernels.grouped_gemm import ag_grouped_gemm, rs_grouped_gemm, stage_own_rows
    from triton_overlap.ops.moe_config import MoEGEMMConfig

    cfg = MoEGEMMConfig.defaults(types.SimpleNamespace(interpreted=False, backend="cuda"))
    failed = 0
    for fn, b_desc in itertools.product((ag_grouped_gemm, rs_grouped_gemm), (0,) if quick else (0, 2)):
        consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_C=cfg.block_c,
                      GROUP_M=cfg.group_m, B_DESC=b_desc, NUM_PROGRAMS=131, CLOCK=1,
                      DOT_F32=False, LOCAL_COUNTERS=True, stride_wn=1)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        sig = {}
        for prm in fn.params:
            n = prm.name
            sig[n] = ("constexpr" if n in consts else WAITER if n == "waiter"
                      else f"tensordesc<bf16[1, {cfg.block_n}, {cfg.block_k}]>" if n == "w" and b_desc
                      else "*bf16" if n in ("x_ptr", "ws_ptr", "w", "out_ptr", "h_ptr", "y_ptr")
                      else "*fp32" if n == "weights_ptr" else "*i64" if n in ("scatter_ptrs", "counter_ptrs")
                      else "*i32" if n.endswith("_ptr") else "i32")
        name = f"{fn.fn.__name__} tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k} B_DESC {b_desc}"
        failed += compile_one(target, name, ASTSource(
            fn=fn, signature=sig, constexprs=consts,
            attrs=divisibility(sig, skip=("rank", "op", "world", "budget", "SLOTS", "TOPK", "M_LOCAL", "M_PER_CHUNK",
                                          "CHUNKS_PER_RANK", "slots", "N", "K"))),
            {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    sig = {n: "*bf16" if n in ("x_ptr", "staged_ptr") else "*i32" if n.endswith("_ptr") else "i32"
           for n in stage_own_rows.arg_names if n not in ("BLOCK_R", "BLOCK_K")}
    consts = dict(BLOCK_R=16, BLOCK_K=256)
    failed += compile_one(target, "stage_own_rows", ASTSource(
        fn=stage_own_rows, signature=dict(sig, BLOCK_R="constexpr", BLOCK_K="constexpr"), constexprs=consts,
        attrs=divisibility(sig, skip=("pairs", "M_LOCAL", "rank", "K"))), {"num_warps": 4})
    return failed


def compile_grouped_hopper(target, quick: bool = False) -> int:
    """kernels.grouped_gemm_hopper and kernels.grouped_gemm_hopper_rs (Gluon; sm_90 only) as the MoE ops launch
    them: the weights [E, K, N] and their transpose [E, N, K], A's rows gathered and (CONTIG: AllGather-MoE's rows
    sent sorted, MoE-ReduceScatter's sorted layout) by TMA, in the K steps each launches (the AllGather kernel's
    gathered ones GATHER_STEPS) (``quick``: [E, K, N])."""
    if target.arch != 90:
        return 0
    from triton_overlap.kernels import grouped_gemm_hopper as gh
    from triton_overlap.kernels import grouped_gemm_hopper_rs as ghr

    failed = 0
    variants = ((False, False), (False, True))
    if not quick:
        variants += ((True, False), (True, True))
    for b_kmajor, contig in variants:
        kernels = ((gh.ag_grouped_hopper, gh.TILES if contig else gh.GATHER_STEPS, {}),
                   (ghr.rs_grouped_hopper, gh.TILES, dict(TOPK=8, BLOCK_C=64, SUB_C=ghr.SUB_C)))
        for fn, steps, extra in kernels:
            bm, bn, bk = steps.block_m, steps.block_n, steps.block_k
            b_type = gluon_desc_type(target, [1, bn, bk] if b_kmajor else [1, bk, bn])
            a_type = gluon_desc_type(target, [bm, bk]) if contig else b_type
            consts = dict(BLOCK_M=bm, BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=131, NUM_STAGES=steps.num_stages,
                          B_KMAJOR=b_kmajor, CLOCK=1, STORE_WARPS=gh.EPILOGUE_WARPS, STORE_REGS=gh.EPILOGUE_REGS,
                          SUB_M=gh.SUB_M, CONTIG=contig, **extra)
            sig = {}
            for prm in fn.params:
                n = prm.name
                sig[n] = ("constexpr" if n in consts else b_type if n == "b_desc"
                          else a_type if n == "a_desc"
                          else "*bf16" if n in ("x_ptr", "ws_ptr", "out_ptr", "h_ptr", "y_ptr")
                          else "*fp32" if n == "weights_ptr" else "*i64" if n in ("scatter_ptrs", "counter_ptrs")
                          else "*i32" if n.endswith("_ptr") else WAITER if n == "waiter" else "i32")
            failed += compile_gluon(target, f"{fn.fn.__name__} b_kmajor={b_kmajor} contig={contig} "
                                    f"k={bk}x{steps.num_stages}", fn, sig, consts,
                                    {"num_warps": 8, "maxnreg": gh.MAXNREG}, 1500)
    return failed


def compile_routing(target) -> int:
    """kernels.routing (the MoE ops' sort by expert) as ops.moe_routing launches it: int64 and int32 ids, 256
    experts, the tiles ordered by their chunks and not."""
    from triton_overlap.kernels import routing as r

    failed = 0
    e_pad, block = 256, 128
    kernels = [(r.count_experts, dict(BLOCK=block, E_CHUNK=64)), (r.scan_counts, dict(E_TILE=32, SCAN_B=64)),
               (r.expert_offsets, dict(E_PAD=e_pad)),
               (r.place_pairs, dict(HAS_REMAP=True, DST=1, BLOCK=block)),
               (r.place_pairs, dict(HAS_REMAP=False, DST=2, BLOCK=block)),
               (r.cut_tiles, dict(BLOCK_M=128, E_PAD=e_pad, BS=32, BY_TAG=True, TAG_PAD=64)),
               (r.cut_tiles, dict(BLOCK_M=128, E_PAD=e_pad, BS=32, BY_TAG=False, TAG_PAD=1)),
               (r.order_tiles, dict(BS=32, TAG_PAD=64, NB_PAD=64))]
    for (fn, consts), ids in itertools.product(kernels, ("*i64", "*i32")):
        sig = {prm.name: "constexpr" if prm.is_constexpr else ids if prm.name == "ids_ptr"
               else "*i64" if prm.name == "order_ptr" else "*i32" if prm.name.endswith("_ptr") else "i32"
               for prm in fn.params}
        name = f"{fn.fn.__name__} ids {ids[1:]} {consts}"
        failed += compile_one(target, name, ASTSource(fn=fn, signature=sig, constexprs=consts), {"num_warps": 4})
    return failed


def compile_ep_routing(target) -> int:
    """kernels.ep_routing (expert-parallel routing) and the scan it shares with kernels.routing, as ops.ep_routing
    launches them on GPUs (the count in three launches, and in one for 2 and 16 blocks): int64 and int32 ids, 256
    and 4 experts, 1, 2 and 8 ranks, top-1, 2, 6 and 8, bf16 rows and fp8 rows (as bytes) with 64 scales, the
    pack into a staging buffer and into the owners' (PUSH), with and without the owners' gather indexes (GATHER),
    and kernels.ep_experts' plan of the overlapped GEMM; arguments not known divisible and (as Triton specialises
    aligned pointers and sizes) known divisible by 16."""
    from triton_overlap.kernels import ep_experts as ee
    from triton_overlap.kernels import ep_routing as r
    from triton_overlap.kernels.routing import scan_counts

    failed = 0
    bt, bh = r.GPU_TILES
    for ids, K, w_pad, e_pad, div in itertools.product(("*i64", "*i32"), (1, 2, 6, 8), (1, 2, 8), (4, 256),
                                                      (False, True)):
        if e_pad < w_pad:
            continue
        kp = 1 << (K - 1).bit_length()
        kernels = [(r.ep_count, dict(K=K, K_PAD=kp, BT=bt, W_PAD=w_pad, E_CHUNK=min(e_pad, 64))),
                   (scan_counts, dict(E_TILE=min(e_pad, 32), SCAN_B=64)),
                   (r.ep_record, dict(W_PAD=w_pad, SCAN_B=32)),
                   *((r.ep_count_record, dict(K=K, K_PAD=kp, BT=bt, W_PAD=w_pad, E_CHUNK=min(e_pad, 64),
                                              NB_PAD=nb_pad, E_TILE=max(16, min(e_pad, 4096 // nb_pad))))
                     for nb_pad in (2, r.ONE_LAUNCH_BLOCKS)),
                   (r.ep_dest, dict(W_PAD=w_pad, E_PAD=e_pad, E_CHUNK=min(e_pad, 32))),
                   (r.ep_expand, dict(K=K, BU=bt, BLOCK_H=bh, G_PAD=0)),
                   (r.ep_expand, dict(K=K, BU=bt, BLOCK_H=bh, G_PAD=64))]
        kernels += [(r.ep_pack, dict(K=K, K_PAD=kp, BT=bt, W_PAD=w_pad, BLOCK_H=bh, G_PAD=g, PUSH=push,
                                     GATHER=gather))  # G_PAD 64: fp8 rows with scales; GATHER: 16-bit rows only
                    for g in (0, 64) for push in (False, True) for gather in ((False, True) if g == 0 else (False,))]
        if K == 1 and ids == "*i64":  # (the GEMM plan reads no ids)
            kernels.append((ee.ep_gemm_plan, dict(BLOCK_M=128, W_PAD=w_pad, EL_PAD=max(1, e_pad // w_pad), BLOCK=256)))
        for fn, consts in kernels:
            rows = ("x_ptr", "rows_ptr", "tokens_ptr")
            row_type = "*u8" if consts.get("G_PAD") else "*bf16"
            sig = {prm.name: "constexpr" if prm.is_constexpr else ids if prm.name == "ids_ptr"
                   else row_type if prm.name in rows
                   else "*i64" if prm.name in ("order_ptr", "rows_ptrs", "meta_ptrs", "gather_ptrs")
                   else "*i32" if prm.name.endswith("_ptr") else "i32" for prm in fn.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, prm in enumerate(fn.params)
                     if div and not prm.is_constexpr}
            name = f"{fn.fn.__name__} ids {ids[1:]} {consts} divisible {div}"
            failed += compile_one(target, name, ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                  {"num_warps": 4})
    return failed


def compile_row_sums(target) -> int:
    """kernels.row_sums as ops.ep_routing and the combine launch them: bf16 rows with and without weights, top-1, 2
    and 8 slots, the GPU tile; the combine's job launch."""
    from triton_overlap.kernels.row_sums import TILE, gather_rows_sum, gather_rows_sum_jobs

    failed = 0
    bm, bn, warps = TILE
    for fn, weight, K in itertools.product((gather_rows_sum, gather_rows_sum_jobs), (False, True), (1, 2, 8)):
        if fn is gather_rows_sum_jobs and not weight:
            continue
        consts = dict(K=K, HAS_WEIGHT=weight, BLOCK_M=bm, BLOCK_N=bn)
        sig = {prm.name: "constexpr" if prm.is_constexpr else "*bf16" if prm.name in ("src_ptr", "out_ptr")
               else "*fp32" if prm.name == "weight_ptr" else "*i64" if prm.name == "out_ptrs"
               else "*i32" if prm.name.endswith(("_ptr", "_ptrs")) else "i32" for prm in fn.params}
        failed += compile_one(target, f"{fn.fn.__name__} {consts}", ASTSource(fn=fn, signature=sig,
                                                                               constexprs=consts),
                              {"num_warps": warps})
    return failed


def compile_moe_rows(target) -> int:
    """kernels.moe_rows as the MoE layers launch them on GPUs: SwiGLU forward and backward and moe_rs's backward row
    pass on bf16 rows (with and without the scaled left operand), the GPU tile."""
    from triton_overlap.kernels.moe_rows import TILE, scaled_row_grads, swiglu_rows, swiglu_rows_grad

    failed = 0
    bm, bn, warps = TILE
    for fn, extra in ((swiglu_rows, {}), (swiglu_rows_grad, {}), (scaled_row_grads, dict(SCALED=True)),
                      (scaled_row_grads, dict(SCALED=False))):
        consts = dict(extra, BLOCK_M=bm, BLOCK_N=bn)
        sig = {prm.name: "constexpr" if prm.is_constexpr else "*fp32" if prm.name in ("scale_ptr", "dot_ptr")
               else "*i32" if prm.name == "src_ptr" else "*bf16" if prm.name.endswith("_ptr") else "i32"
               for prm in fn.params}
        failed += compile_one(target, f"{fn.fn.__name__} {consts}", ASTSource(fn=fn, signature=sig,
                                                                               constexprs=consts),
                              {"num_warps": warps})
    return failed


def compile_ep_low_latency(target) -> int:
    """kernels.ep_low_latency as ops.ep_low_latency launches them on GPUs: bf16 rows and fp8 rows (as bytes) with
    56 scales, top-1 and 8, 1, 2 and 8 ranks, 4 and 256 experts; arguments not known divisible and known divisible
    by 16 (but the waiter's)."""
    from triton_overlap.kernels import ep_low_latency as ll
    from triton_overlap.kernels.ep_routing import GPU_TILES

    failed = 0
    bt, bh = GPU_TILES
    for K, w_pad, e, fp8, div in itertools.product((1, 8), (1, 2, 8), (4, 256), (False, True), (False, True)):
        if e < w_pad:
            continue
        kp, el_pad = 1 << (K - 1).bit_length(), max(1, e // w_pad)
        g = 64 if fp8 else 0
        kernels = [(ll.ll_send, dict(K=K, K_PAD=kp, BT=bt, W_PAD=w_pad, BLOCK_H=bh, G_PAD=g,
                                     REC_PAD=1 << (3 + w_pad + e - 1).bit_length())),
                   (ll.ll_expand, dict(K=K, K_PAD=kp, BU=bt, BLOCK_H=bh, G_PAD=g, W_PAD=w_pad, EL_PAD=el_pad,
                                       CLOCK=1))]
        if not fp8:
            kernels += [(ll.ll_combine_send, dict(K=K, K_PAD=kp, BU=16, BLOCK_N=256, W_PAD=w_pad)),
                        (ll.ll_combine_recv, dict(W_PAD=w_pad, BLOCK_M=16, BLOCK_N=256, CLOCK=1))]
        for fn, consts in kernels:
            rows = ("x_ptr", "rows_ptr", "tokens_ptr", "y_ptr", "back_ptr", "out_ptr")
            sig = {prm.name: "constexpr" if prm.is_constexpr else WAITER if prm.name == "waiter"
                   else ("*u8" if fp8 else "*bf16") if prm.name in rows else "*i64" if prm.name.endswith("_ptrs")
                   else "*fp32" if prm.name == "slot_w_ptr" and fn is ll.ll_combine_send
                   else "*i32" if prm.name.endswith("_ptr") else "i32" for prm in fn.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, prm in enumerate(fn.params)
                     if div and not prm.is_constexpr and prm.name != "waiter"}
            name = f"{fn.fn.__name__} {consts} fp8 {fp8} divisible {div}"
            failed += compile_one(target, name, ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                  {"num_warps": 4})
    return failed

def ptxas_report(cubin_ptx: str, arch: int) -> str:
    try:  # the ptxas Triton itself takes for this arch (newer Triton: a second, newer one from sm_90 up)
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
    except ImportError:
        ptxas = triton.knobs.nvidia.ptxas.path if hasattr(triton, "knobs") else "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(cubin_ptx)
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return (f"regs {regs.group(1) if regs else '?'}, spill stores {spill.group(1) if spill else '?'}"
            + (", wgmma SERIALISED (C7514/C7515)" if "C7514" in text or "C7515" in text else ""))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--quick", action="store_true", help="GEMM-RS variants only")
    args = p.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    bm, bn, bk = 128, 256, 64
    failed = 0
    src = ASTSource(fn=spin_kernel, signature={"ticks": "i64", "CLOCK": "constexpr"}, constexprs={"CLOCK": 1})
    triton.compile(src, target=target, options={"num_warps": 1})
    print("spin_kernel: compiled")
    failed += compile_signals(target)
    failed += compile_gemm_all_reduce(target)
    failed += compile_skinny_gemm(target)
    failed += compile_attention(target)
    failed += compile_warp_specialized(target)
    failed += compile_gather_hopper(target)
    failed += compile_attention_ws(target)
    failed += compile_attention_bwd_ws(target)
    failed += compile_grouped_gemm(target)
    failed += compile_grouped_hopper(target)
    failed += compile_routing(target)
    failed += compile_ep_routing(target)
    failed += compile_row_sums(target)
    failed += compile_moe_rows(target)
    failed += compile_ep_low_latency(target)
    # (GATHER, SCATTER, REDUCE_OWN, DESC, WHOLE_TILES, LOCAL_COUNTERS, SPLIT_EPILOGUE, CLAIM, DEFER_RELEASE)
    variants = [(False, True, fuse, desc, whole, local, split, claim, defer, False)
                for fuse, desc, whole, local, split, claim, defer
                in itertools.product((False, True), (False, True), (False, True), (False, True), (False, True), (0, 1),
                                     (False, True))
                if (whole or not fuse) and (fuse or not split) and (fuse or claim == 1) and (local or not args.quick)
                and (desc or not args.quick)]
    if not args.quick:
        variants += [(gather, False, False, desc, False, False, False, 1, False, desc_c)
                     for gather, desc, desc_c in itertools.product((True, False), (False, True), (False, True))]
    for gather, scatter, fuse, desc, whole, local, split, claim, defer, desc_c in variants:
        consts = dict(HAS_BIAS=False, GATHER=gather, SCATTER=scatter, REDUCE_OWN=fuse, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, GROUP_M=8, NUM_PROGRAMS=131, NUM_XCDS=1, EVEN_K=True, CLOCK=1, DOT_F32=False,
                      ALIGN_C=scatter, DESC=desc, B_KMAJOR=False, SCALED=False, WHOLE_TILES=whole,
                      LOCAL_COUNTERS=local, SPLIT_EPILOGUE=split, CLAIM=claim, DEFER_RELEASE=defer and scatter,
                      DESC_C=desc_c, RESET_AT_EXIT=fuse or gather)
        if not desc:
            consts.update(a_desc=None, b_desc=None)
        if not desc_c:
            consts.update(c_desc=None)
        fn = gather_gemm if gather else scatter_gemm if scatter else persistent_gemm
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        name = (f"gather={gather} scatter={scatter} reduce_own={fuse} desc={desc} whole_tiles={whole} "
                f"local_counters={local} split_epilogue={split} claim={claim} defer_release={defer} desc_c={desc_c}")
        try:
            sig = gemm_signature(fn, desc, bm, bn, bk, False, gather, desc_c)
            for unit in ("stride_cn", "stride_bn"):  # 1 at every launch: Triton specialises it as a constant
                sig[unit] = "constexpr"
                consts[unit] = 1
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts,
                                         attrs=divisibility(sig)), target=target,
                               options={"num_warps": 8, "num_stages": 4})
            print(f"{name}: {ptxas_report(k.asm['ptx'], args.arch)}, shared {k.metadata.shared} B")
        except Exception as e:  # noqa: BLE001 - reported, the check goes on
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[-600:]}")
    print(f"triton {triton.__version__}: {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
