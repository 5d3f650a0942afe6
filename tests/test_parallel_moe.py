"""MoEParallel (triton_overlap.nn.parallel_moe) in torch's parallelize_module: unmodified Hugging Face Qwen3-MoE,
Mixtral, Qwen2-MoE (a gated shared expert) and GLM-4.5 (DeepSeek-V3's sigmoid router with a correction bias, an
ungated shared expert, a dense first layer) causal LMs, tensor + sequence parallel with the Llama plan of
test_parallel_styles.py and the style on every sparse-MoE block (or hf_plan's plan), against the same model unsharded
in float64: logits and every gradient (the experts' as this rank's shards, the shared expert's among them, the
routers' and the shared expert gate's replicated DTensors summed over ranks), also expert parallel and without
sequence parallelism (decode), DeepSeek-V3 (latent attention) through hf_plan; generate() on the decode plan;
Qwen3-Next's, Qwen3.5-MoE's, DeepSeek-V3's (grouped routing) and OLMoE's blocks alone, DeepSeek-V3's decode block
replayed in a CUDA graph; and the blocks the style refuses."""
import copy

import pytest
import torch
from torch import nn

import triton_overlap as to
from refs import (check_full_grads, check_full_state_dict, check_grad_clipping, check_resume, check_sharded_checkpoint,
                  rel_err, with_latent_attention_plan)

TOL_LOGITS, TOL_GRAD = 2e-2, 4e-2  # bf16 kernels against float64 on the same bf16-rounded weights
#: parameters of attention that transformers initializes to one value, drawn at random instead (a slice of the wrong
#: heads would compute the same)
ATTENTION_CONSTANTS = ("linear_attn", "q_norm", "k_norm")
VOCAB = 96


def _model(kind, W, dtype, dense_last=False):
    """A small random ``kind`` ("qwen3", "mixtral", "qwen2": a shared expert twice an expert's width, gated;
    "glm4": the same ungated, DeepSeek-V3's router with a random correction bias and two groups of experts, one
    kept, routed weights scaled by 2.5, the first layer dense, attention biases, per-head q/k norms that its plan
    leaves out; "deepseek_v3": GLM-4.5's MoE under multi-head latent attention; "minimax_m2": sigmoid top-k with
    the block's random correction bias, q/k norms over all heads; "olmoe": softmax top-k without renormalization,
    q/k norms over all heads, no pipeline plan; "qwen3_5_moe": a gated delta-rule linear attention layer, then a
    full attention one, Qwen2-MoE's block; "qwen3_next": the same with Qwen3-Next's fused projections; "gpt_oss":
    attention with sinks, a sliding window of 3 on the first layer, GPT-OSS's block) causal LM
    whose heads, KV heads,
    width and experts' width split over W ranks; 4 experts, top-2; weights rounded to bf16 and the same on every
    rank. ``dense_last`` (qwen3): the last layer's MLP dense."""
    common = dict(vocab_size=VOCAB, hidden_size=16 * 2 * W, num_hidden_layers=2, num_attention_heads=2 * W,
                  num_key_value_heads=W, head_dim=16, num_experts_per_tok=2, attn_implementation="sdpa",
                  experts_implementation="eager",  # the reference runs in float64: a loop over experts
                  use_cache=False)
    if kind == "qwen3":
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model

        config = Config(num_experts=4, moe_intermediate_size=8 * W, intermediate_size=8 * W, norm_topk_prob=True,
                        mlp_only_layers=[1] if dense_last else [], **common)
    elif kind == "qwen2":
        from transformers import Qwen2MoeConfig as Config, Qwen2MoeForCausalLM as Model

        config = Config(num_experts=4, moe_intermediate_size=8 * W, shared_expert_intermediate_size=16 * W,
                        intermediate_size=8 * W, norm_topk_prob=False, **common)
    elif kind == "deepseek_v3":  # multi-head latent attention (q and kv latents), GLM-4.5's MoE
        from transformers import DeepseekV3Config as Config, DeepseekV3ForCausalLM as Model

        common.pop("head_dim")
        common["num_key_value_heads"] = common["num_attention_heads"]  # (latent attention: a key per query head)
        config = Config(n_routed_experts=4, moe_intermediate_size=8 * W, n_shared_experts=2, intermediate_size=8 * W,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        **common)
        with_latent_attention_plan(config)
    elif kind == "glm4":
        from transformers import Glm4MoeConfig as Config, Glm4MoeForCausalLM as Model

        config = Config(n_routed_experts=4, moe_intermediate_size=8 * W, n_shared_experts=2, intermediate_size=8 * W,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                        n_group=2, topk_group=1, **common)
    elif kind == "qwen3_5_moe":  # a gated delta-rule layer, then a full attention layer (gated, per-head q/k norms)
        from transformers import Qwen3_5MoeForCausalLM as Model
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Config

        config = Config(num_experts=4, moe_intermediate_size=8 * W, shared_expert_intermediate_size=16 * W,
                        linear_num_key_heads=W, linear_num_value_heads=2 * W, linear_key_head_dim=8,
                        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], **common)
    elif kind == "qwen3_next":  # Qwen3.5-MoE's layers, the linear attention's projections laid out by key head
        from transformers import Qwen3NextConfig as Config, Qwen3NextForCausalLM as Model

        config = Config(num_experts=4, moe_intermediate_size=8 * W, shared_expert_intermediate_size=16 * W,
                        linear_num_key_heads=W, linear_num_value_heads=2 * W, linear_key_head_dim=8,
                        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], **common)
    elif kind == "olmoe":  # no pipeline plan: hf_plan finds the region's edges by their names
        from transformers import OlmoeConfig as Config, OlmoeForCausalLM as Model

        config = Config(num_experts=4, intermediate_size=8 * W, norm_topk_prob=False, **common)
    elif kind == "minimax_m2":
        from transformers import MiniMaxM2Config as Config, MiniMaxM2ForCausalLM as Model

        config = Config(num_local_experts=4, intermediate_size=8 * W, rotary_dim=8, **common)
    elif kind == "gpt_oss":  # attention with sinks, which its plan leaves out, a sliding window on its first layer
        from transformers import GptOssConfig as Config, GptOssForCausalLM as Model

        common["attn_implementation"] = "eager"  # (its sdpa path takes no sinks)
        config = Config(num_local_experts=4, intermediate_size=8 * W, sliding_window=3, **common)
    else:
        from transformers import MixtralConfig as Config, MixtralForCausalLM as Model

        config = Config(num_local_experts=4, intermediate_size=8 * W, **common)
    torch.manual_seed(0)
    model = Model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # (Qwen3's router: 0s; q/k norms, Qwen3.5's dt_bias: 1s)
            if p.unique().numel() == 1 and (p.abs().max() == 0 or any(k in name for k in ATTENTION_CONSTANTS)):
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.to(dtype)


def _plan(ctx, kind, fallback, ep=False):
    """test_parallel_styles.py's Llama plan with the MoE block's style (``ep``: expert parallel) in place of the MLP's
    linear styles; Qwen3's per-head q/k norms (replicated weights read by this rank's heads) as torch's
    SequenceParallel on the head dim."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from triton_overlap.nn import ColwiseParallel, GatherSequence, MoEParallel, RowwiseParallel, ShardSequence

    col, row = ColwiseParallel(ctx, fallback=fallback), RowwiseParallel(ctx, fallback=fallback)
    plan = {"model.embed_tokens": ShardSequence(ctx), "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.self_attn.[qkv]_proj": col, "model.layers.*.self_attn.o_proj": row,
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.mlp": MoEParallel(ctx, fallback=fallback, expert_parallel=ep),
            "model.norm": GatherSequence(ctx)}
    if kind == "qwen3":
        plan["model.layers.*.self_attn.[qk]_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _grad_errors(model, reference, rank, W, ep=False):
    """Every parameter's gradient against the reference's: a DTensor's summed over ranks; a linear layer's shard
    against its rows or columns; the experts' shards against the same shards of the reference's
    (nn.moe.shard_experts of its gate, up and down, a shared expert's after them, cut into the experts' width;
    ``ep``: this rank's whole experts, a shared expert's weights replicated DTensors)."""
    from torch.distributed.tensor import DTensor

    from triton_overlap.nn.moe import shard_experts

    errs, ref = {}, dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if not ref[name].requires_grad:  # (Ernie 4.5's correction bias)
            assert not p.requires_grad, name
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        full = ref[name].grad
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):  # (Qwen3.5's)
            # (Qwen3.5's gated delta-rule layer: this rank's query, key and value channels)
            layer = reference.get_submodule(name[:name.index("linear_attn") + len("linear_attn")])
            k, v = layer.key_dim // W, layer.value_dim // W
            rows = [*range(rank * k, (rank + 1) * k), *range(layer.key_dim + rank * k, layer.key_dim + (rank + 1) * k),
                    *range(2 * layer.key_dim + rank * v, 2 * layer.key_dim + (rank + 1) * v)]
            errs[name] = rel_err(g, full[rows])
            continue
        if name.startswith("experts.") or ".experts." in name:
            block = name[:name.rindex("experts.")]  # "model.layers.0.mlp." or, for a block alone, ""
            gate, up, down, biases = _expert_grads(reference.get_submodule(f"{block}experts"))
            if name.endswith("_bias"):  # (GPT-OSS's: gate/up's as their columns, down's whole or this rank's)
                b1, b3, b2 = biases
                mine = slice(rank * g.shape[0], (rank + 1) * g.shape[0]) if ep else slice(None)
                cols = slice(None) if ep else slice(rank * b1.shape[1] // W, (rank + 1) * b1.shape[1] // W)
                full = b2[mine] if name.endswith("down_proj_bias") else torch.cat([b1[mine, cols], b3[mine, cols]], 1)
                errs[name] = rel_err(g, full)
                continue
            if ep:
                local = g.shape[0]
                mine = slice(rank * local, (rank + 1) * local)
                errs[name] = rel_err(g, shard_experts(gate[mine], up[mine], down[mine], 0, 1)[
                    name.endswith("down_proj")])
                continue
            shared = next((f"{block}{n}." for n in ("shared_expert", "shared_experts")
                           if f"{block}{n}.gate_proj.weight" in ref), None)
            if shared:
                hidden = gate.shape[1]
                s1, s3, s2 = (ref[f"{shared}{n}_proj.weight"].grad for n in ("gate", "up", "down"))
                gate, up = (torch.cat([w, torch.stack(s.split(hidden))]) for w, s in ((gate, s1), (up, s3)))
                down = torch.cat([down, torch.stack(s2.split(hidden, dim=1))])
            full = shard_experts(gate, up, down, rank, W)[name.endswith("down_proj")]
        elif g.shape != full.shape:
            dim = 0 if g.shape[0] != full.shape[0] else 1
            full = full.narrow(dim, rank * g.shape[dim], g.shape[dim])
        errs[name] = rel_err(g, full)
        other = _grad_scale(reference, name)
        if other is not None:  # (a gradient that is 0 but for rounding: this rank's rows of the other where g is)
            if g.shape != ref[name].grad.shape:
                other = other.narrow(0, rank * other.shape[0] // W, other.shape[0] // W)
            errs[name] = float((g.double().cpu() - full.double().cpu()).norm() / other.double().cpu().norm())
    return errs


def _grad_scale(reference, name):
    """The reference gradient, whole, whose norm a gradient that is 0 but for rounding is measured against
    (_grad_errors; refs.check_full_grads' ``scale``); None: the gradient's own.

    * The decay's (``A_log``, ``dt_bias``): its gradients nearly vanish with few tokens (about 1e-7 in decode:
      below bf16's resolution of the loss); against in_proj_a's (Qwen3-Next: in_proj_ba's) weight's, which the same
      path feeds.
    * A router bias's (GPT-OSS's): a softmax's logit gradients sum to 0 over a token's choices, so an expert's sum
      over tokens cancels in part; against the size of its terms, which the router weight's gradient row (the same
      terms times rows of unit mean square) carries times sqrt(dim).
    * A key bias's: it adds one constant to each query's scores, to which softmax is blind; against the value
      bias's (Qwen2's)."""
    if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
        layer = reference.get_submodule(name.rpartition(".")[0])
        return getattr(layer, "in_proj_a", getattr(layer, "in_proj_ba", None)).weight.grad
    if name.endswith("router.bias"):
        weight = reference.get_parameter(name.replace(".bias", ".weight")).grad
        return weight / weight.shape[1] ** 0.5
    if name.endswith("k_proj.bias"):
        return reference.get_parameter(name.replace("k_proj", "v_proj")).grad
    return None


def _expert_grads(experts):
    """The gradients of a reference's experts as (gate, up [E, hidden, dim], down [E, dim, hidden], biases): their
    fused parameters' (transposed and interleaved where the experts say so: GPT-OSS's), ``biases`` (gate, up
    [E, hidden], down [E, dim]) or None."""
    gate_up, down = experts.gate_up_proj.grad, experts.down_proj.grad
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    interleaved = not getattr(experts, "is_concatenated", True)
    halves = (lambda t: (t[:, 0::2], t[:, 1::2])) if interleaved else (lambda t: t.chunk(2, dim=1))
    bias = getattr(experts, "gate_up_proj_bias", None)
    biases = None if bias is None else (*halves(bias.grad), experts.down_proj_bias.grad)
    return *halves(gate_up), down, biases


ROUTING_MARGIN = 0.04  # bf16 activations move router logits by ~1 % of their size; ties closer than this flip


def _decisive(gate, logits, bias=None) -> bool:
    """Whether the router ``gate``'s choice from float64 ``logits`` [T, E] has no near tie: for a softmax router the
    k-th largest logit exceeds the next by ROUTING_MARGIN of the token's largest (DeepSeek-V2's: also between its
    kept groups' best logits and the next group's, the k-th among the kept groups); for DeepSeek-V3's (a correction
    bias, groups) the same margin, a quarter of it after the sigmoid (whose slope is at most 1/4), between the kept
    groups' scores and the next group's, and between the k-th choice among the kept groups' experts and the next;
    MiniMax-M2's (``bias``: the block's correction bias) also the softmax router's margin, which its model's
    load-balancing loss reads; for Ernie 4.5's (softmax plus a correction bias) a quarter of the margin between the
    k-th choice score and the next."""
    from triton_overlap.nn.routers import BiasedSoftmax, correction_bias, router_rule

    k, margin = gate.top_k, ROUTING_MARGIN * logits.abs().amax(-1)
    from_block = bias is not None  # (MiniMax-M2: the block's bias)
    bias = correction_bias(gate) if bias is None else bias
    if bias is not None and isinstance(router_rule(gate, "_decisive", bias if from_block else None), BiasedSoftmax):
        top = (logits.softmax(-1) + bias.double().reshape(-1)).topk(k + 1, dim=-1).values
        return bool((top[:, k - 1] - top[:, k] >= margin / 4).all())
    if bias is None:
        groups, keep = getattr(gate, "num_group", 1), getattr(gate, "topk_group", 1)
        if getattr(gate, "topk_method", None) == "group_limited_greedy" and keep < groups:  # DeepSeek-V2's
            T, E = logits.shape  # (a group's best softmax score ranks as its best logit)
            best = logits.view(T, groups, E // groups).amax(-1).topk(keep + 1, dim=-1)
            if not (best.values[:, keep - 1] - best.values[:, keep] >= margin).all():
                return False
            kept = torch.zeros(T, groups, dtype=torch.bool, device=logits.device)
            kept.scatter_(1, best.indices[:, :keep], True)
            logits = logits.masked_fill(~kept.unsqueeze(-1).expand(T, groups, E // groups).reshape(T, E), -torch.inf)
        top = logits.topk(min(k + 1, logits.shape[1]), dim=-1).values
        return k == logits.shape[1] or bool((top[:, k - 1] - top[:, k] >= margin).all())
    if from_block:  # MiniMax-M2's load-balancing loss picks the top k of the softmax of the logits
        top = logits.topk(k + 1, dim=-1).values
        if not bool((top[:, k - 1] - top[:, k] >= margin).all()):
            return False
    choice, margin = torch.sigmoid(logits) + bias.double(), margin / 4
    T, E = choice.shape
    groups, keep = getattr(gate, "num_group", 1), getattr(gate, "topk_group", 1)
    if keep < groups:
        best = choice.view(T, groups, E // groups).topk(2, dim=-1).values.sum(-1)
        top = best.topk(keep + 1, dim=-1)
        if not (top.values[:, keep - 1] - top.values[:, keep] >= margin).all():
            return False
        kept = torch.zeros_like(best).scatter_(1, top.indices[:, :keep], 1.0).bool()
        choice = choice.masked_fill(~kept.unsqueeze(-1).expand(T, groups, E // groups).reshape(T, E), -torch.inf)
    top = choice.topk(min(k + 1, E), dim=-1).values  # (a -inf next choice: no tie)
    return k == E or bool((top[:, k - 1] - top[:, k] >= margin).all())


def _routes_decisively(reference, tokens) -> bool:
    """Whether ``tokens``' routing in ``reference`` has no near tie (``_decisive``) in any layer."""
    gates = [m for m in reference.modules() if type(m).__name__.lower().endswith("router")]
    logits = {}  # router -> its logits of the latest forward (not every model returns them: GLM-4.5 before 5.25)
    hooks = [g.register_forward_hook(lambda m, args, out: logits.__setitem__(m, (out[0], args[1:]))) for g in gates]
    try:
        with torch.no_grad():
            reference(tokens)
    finally:
        for h in hooks:
            h.remove()
    return all(_decisive(g, logits[g][0].double(), *logits[g][1]) for g in gates)  # (MiniMax-M2: the bias)


def _decisive_tokens(reference, B, S, dev):
    """Tokens ``[B, S]`` whose routing in ``reference`` has no near tie (``_routes_decisively``). A near tie
    routes a token to another expert in bf16 than in float64, which changes that expert's gradient by tens of
    percent (with 8 to 12 tokens a rank); the first of a fixed sequence of draws that qualifies, the same on every
    rank."""
    for seed in range(1000):
        tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed)).to(dev)
        if _routes_decisively(reference, tokens):
            return tokens
    raise AssertionError("no draw of tokens routes without near ties")


def _moe_case(kind, mode, fallback, hf=False, ep=False):
    """``mode``: "bf16" (bf16 parameters), "autocast" (float32 parameters under torch.autocast(bfloat16)),
    "checkpointed" (bf16, transformers' activation checkpointing on: each layer runs again in backward) or
    "decode" (bf16, hf_plan's plan without sequence parallelism: every token on every rank, 3 of them); ``hf``:
    the plan hf_plan makes of the model's own (Qwen3-MoE's with its last layer dense); ``ep``: the MoE blocks expert
    parallel. Batch 2, sequence 4W. Returns the worst (name, error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import hf_plan, param_groups

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        dtype = torch.float32 if mode == "autocast" else torch.bfloat16
        model = _model(kind, W, dtype, dense_last=hf and kind == "qwen3").to(dev)
        reference = copy.deepcopy(model).double()
        decode = mode == "decode"
        plan = hf_plan(model, ctx, fallback=fallback, expert_parallel=ep, sequence_parallel=not decode) if hf \
            else _plan(ctx, kind, fallback, ep)
        unmodified = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize_module(model, init_device_mesh(dev.type, (W,)), plan)
        check_full_state_dict(model, unmodified)
        check_sharded_checkpoint(model, unmodified)
        if mode == "checkpointed":
            model.gradient_checkpointing_enable({"use_reentrant": False})
        mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
        calls = []  # the MoE block's forward calls: a checkpointed layer runs again in backward
        mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        shared = kind in ("qwen2", "glm4", "deepseek_v3", "qwen3_5_moe", "qwen3_next")
        assert (kind in ("qwen2", "qwen3_5_moe", "qwen3_next")) == isinstance(
            getattr(mlp, "shared_expert_gate", None), torch.nn.Module)
        if ep:  # this rank's whole experts; a shared expert kept, its weights replicated
            assert tuple(mlp.experts.gate_up_proj.shape) == (4 // W, 32 * W, 16 * W)
            kept = getattr(mlp, "shared_expert", getattr(mlp, "shared_experts", None))
            assert shared == (kept is not None) and (not shared or isinstance(kept.up_proj.weight, DTensor))
        else:  # the shared expert as two more experts
            assert tuple(mlp.experts.gate_up_proj.shape) == (4 + 2 * shared, 32 * W, 16)
            assert not hasattr(mlp, "shared_expert") and not hasattr(mlp, "shared_experts")
        assert isinstance(getattr(mlp, mlp.tp_router).weight, DTensor)  # (GPT-OSS's router: "router")
        B, S = 2, 3 if decode else 4 * W
        tokens = _decisive_tokens(reference, B, S, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
            out = model(tokens, output_router_logits=True)
        ref_out = reference(tokens, output_router_logits=True)
        logits, ref_logits = out.logits, ref_out.logits
        assert logits.shape == (B, S, VOCAB)
        loss, ref_loss = logits.float().square().mean(), ref_logits.square().mean()
        if decode and getattr(out, "aux_loss", None) is not None:  # every token's load-balancing loss on every rank
            loss, ref_loss = loss + out.aux_loss, ref_loss + ref_out.aux_loss
        loss.backward()
        ref_loss.backward()
        ctx.check()
        assert len(calls) == (2 if mode == "checkpointed" else 1), (mode, len(calls))
        errs = {"logits": rel_err(logits.detach(), ref_logits.detach()),
                **_grad_errors(model, reference, ctx.rank, W, ep)}
        # transformers' router-logit recorder saw each router's logits of this rank's tokens (decode: all tokens)
        r, s = (0, S) if decode else (ctx.rank, S // W)
        recorded = getattr(out, "router_logits", None) is not None  # (GLM-4.5's before transformers 5.25: not)
        assert recorded == (getattr(ref_out, "router_logits", None) is not None)
        for i, (got, full) in enumerate(zip(out.router_logits, ref_out.router_logits, strict=True) if recorded else ()):
            mine = full.detach().view(B, S, -1)[:, r * s:(r + 1) * s].reshape(got.shape)
            errs[f"router_logits.{i}"] = rel_err(got.detach(), mine)
        assert getattr(out, "aux_loss", None) is None if kind in ("glm4", "deepseek_v3") else \
            torch.isfinite(out.aux_loss)
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > (TOL_LOGITS if "logits" in k else TOL_GRAD)}
        assert not bad, f"rank {ctx.rank}: {bad}"
        check_full_grads(model, reference, TOL_GRAD, lambda name: _grad_scale(reference, name))
        check_grad_clipping(model, reference, lambda: _grad_errors(model, reference, ctx.rank, W, ep), TOL_GRAD)
        check_resume(model, torch.optim.AdamW(param_groups(model), lr=1e-3))
        assert mlp.last_path == ("fallback" if fallback == "always" else "overlap"), mlp.last_path
        assert [type(op).__name__ for op in mlp.tp_ops] == (
            ["AllReduce"] if decode else ["ExpertParallel"] if ep else ["AllGatherMoEGEMM", "MoEGEMMReduceScatter"])
        if mode == "autocast":  # float32 parameters keep float32 gradients
            assert all(p.grad.dtype == torch.float32 for p in mlp.parameters())
        return max(errs.items(), key=lambda kv: kv[1])


def _moe_beside_fsdp(ep):
    """Mixtral's MoE blocks tensor (``ep``: expert) parallel within each half of a 2 x 2 mesh, FSDP2 across the
    halves (test_parallel_styles' dense case, for MoEParallel): each half its own 2 sequences; logits and every
    gradient (FSDP2's mean over the halves) against the unmodified model's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.kernels.cached_launch import triton_interprets
    from triton_overlap.nn import hf_plan, param_groups

    mesh = init_device_mesh("cpu" if triton_interprets() else "cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    with to.Context(mesh["tp"].get_group(), timeout_s=120) as ctx:
        model = _model("mixtral", 2, torch.bfloat16).to(ctx.device)
        reference = copy.deepcopy(model).double()
        unmodified = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize_module(model, mesh["tp"], hf_plan(model, ctx, fallback="never", expert_parallel=ep))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        check_full_state_dict(model, unmodified)  # (FSDP2's shards of the tensor-parallel shards)
        check_sharded_checkpoint(model, unmodified)
        half = mesh["dp"].get_local_rank()
        tokens = _decisive_tokens(reference, 4, 8, ctx.device)
        logits = model(tokens[2 * half:2 * half + 2]).logits
        logits.float().square().mean().backward()
        ref_logits = reference(tokens).logits
        ref_logits.square().mean().backward()
        ctx.check()
        errs = {"logits": rel_err(logits.detach(), ref_logits[2 * half:2 * half + 2].detach()),
                **_grad_errors(model, reference, ctx.rank, 2, ep)}
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > (TOL_LOGITS if "logits" in k else TOL_GRAD)}
        assert not bad, f"rank {mesh.get_rank()}: {bad}"
        check_full_grads(model, reference, TOL_GRAD, lambda name: _grad_scale(reference, name))  # (over dp, then tp)
        check_grad_clipping(model, reference, lambda: _grad_errors(model, reference, ctx.rank, 2, ep), TOL_GRAD)
        check_resume(model, torch.optim.AdamW(param_groups(model), lr=1e-3))  # (FSDP2's shards of the TP shards)
        mlp = model.model.layers[0].mlp
        assert mlp.last_path == "overlap" and type(mlp.tp_ops[0]).__name__ == (
            "ExpertParallel" if ep else "AllGatherMoEGEMM")
        return max(errs.values())


@pytest.mark.parametrize("ep", [False, True], ids=["tensor_parallel", "expert_parallel"])
def test_moe_beside_fsdp(pool, ep):
    pytest.importorskip("transformers")
    if pool.world != 4:
        pytest.skip("a 2 x 2 mesh: W = 4")
    if pool.backend == "cuda-shared":
        pytest.skip("FSDP2's collectives of CUDA tensors over gloo (ranks sharing a GPU) end the ranks with SIGSEGV")
    pool.run(_moe_beside_fsdp, ep)


MOE_CASES = [("qwen3", "bf16", "never"), ("mixtral", "bf16", "never"), ("mixtral", "autocast", "never"),
             ("qwen3", "bf16", "always"), ("qwen3", "bf16", "never", True),
             ("mixtral", "bf16", "never", True), ("qwen2", "bf16", "never"), ("qwen2", "autocast", "never", True),
             ("glm4", "bf16", "never", True), ("mixtral", "bf16", "never", False, True),
             ("qwen2", "autocast", "never", False, True), ("glm4", "bf16", "never", True, True),
             ("mixtral", "decode", "never", True), ("qwen2", "decode", "never", True),
             ("glm4", "decode", "never", True, True), ("qwen2", "decode", "never", True, True),
             ("deepseek_v3", "bf16", "never", True), ("deepseek_v3", "decode", "never", True, True),
             ("mixtral", "decode", "always", True), ("minimax_m2", "bf16", "never", True),
             ("minimax_m2", "decode", "never", True), ("olmoe", "bf16", "never", True),
             ("qwen3_5_moe", "bf16", "never", True), ("qwen3_5_moe", "decode", "never", True),
             ("qwen3_next", "bf16", "never", True), ("qwen3_next", "decode", "never", True),
             ("gpt_oss", "bf16", "never", True), ("gpt_oss", "decode", "never", True),
             ("gpt_oss", "bf16", "never", True, True), ("mixtral", "checkpointed", "never", True),
             ("mixtral", "checkpointed", "never", True, True)]
#: MOE_CASES the host backend skips (CI time): decode cases but Mixtral's (tensor parallel), DeepSeek-V3's (expert
#: parallel) and Qwen3.5-MoE's (linear attention), which cover the modes; Mixtral's decode through the fallback;
#: GPT-OSS's decode and expert-parallel models (its blocks alone run both there)
HOST_SKIPS = (13, 14, 15, 18, 20, 25, 27, 28)


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_moe_model_matches_unmodified_model(pool, case):
    transformers = pytest.importorskip("transformers")
    kind, hf, ep = MOE_CASES[case][0], MOE_CASES[case][3:4] == (True,), MOE_CASES[case][4:] == (True,)
    _skip_unshipped(transformers, kind, hf)
    if pool.world > 3:
        pytest.skip("W = 2, 3 on the host backend (heads, KV heads, width and experts' width divide by 3)")
    if pool.world == 3 and ep:
        pytest.skip("expert parallel: the 4 experts split over W = 2")
    if pool.world == 3 and (pool.backend == "host" or MOE_CASES[case] != ("qwen2", "bf16", "never")):
        pytest.skip("W = 3: the Qwen2-MoE model with its shared expert, on GPUs (CI time; the host backend runs the "
                    "blocks alone at W = 3); every case at W = 2")
    if pool.backend == "host" and case in HOST_SKIPS:
        pytest.skip("decode cases the host backend leaves to GPUs (CI time): its decode cases are Mixtral's and "
                    "DeepSeek-V3's; GPT-OSS's decode and expert-parallel models, whose blocks alone it runs")
    pool.run(_moe_case, *MOE_CASES[case])


def _padded_case(kind):
    """A batch of two, the first sequence left-padded past rank 0's positions, through hf_plan's sequence-parallel plan:
    the logits of the positions the mask keeps against the unmodified model's with the same mask (Qwen3.5's and
    Qwen3-Next's linear attention zero the padded positions' input; GatedDeltaNetParallel does it on each rank's
    shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import hf_plan

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        model = _model(kind, W, torch.bfloat16).to(dev)
        reference = copy.deepcopy(model).double()
        parallelize_module(model, init_device_mesh(dev.type, (W,)), hf_plan(model, ctx, fallback="never"))
        S = 4 * W
        tokens = _decisive_tokens(reference, 2, S, dev)
        mask = torch.ones(2, S, dtype=torch.long, device=dev)
        mask[0, :S // W + 1] = 0  # (past rank 0's positions)
        with torch.no_grad():
            logits = model(tokens, attention_mask=mask).logits
            ref_logits = reference(tokens, attention_mask=mask).logits
        ctx.check()
        keep = mask.bool()
        err = rel_err(logits[keep], ref_logits[keep])
        assert err < TOL_LOGITS, f"rank {ctx.rank}: logits rel err {err:.2e}"
        return err


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_linear_attention_takes_a_padding_mask(pool, kind):
    transformers = pytest.importorskip("transformers")
    _skip_unshipped(transformers, kind)
    if pool.world != 2 or pool.backend == "host" and kind != "qwen3_5_moe":
        pytest.skip("W = 2 (the host backend: Qwen3.5-MoE's; GPUs both)")
    pool.run(_padded_case, kind)


def _skip_unshipped(transformers, kind, hf=True):
    """Skip where this transformers lacks the model ``kind``, or (``hf``) ships plans hf_plan cannot take whole."""
    from triton_overlap.nn.plans import expert_keys

    config = {"qwen2": "Qwen2MoeConfig", "glm4": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config",
              "minimax_m2": "MiniMaxM2Config", "olmoe": "OlmoeConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig",
              "qwen3_next": "Qwen3NextConfig", "gpt_oss": "GptOssConfig"}.get(kind)
    if config and not hasattr(transformers, config):
        pytest.skip(f"transformers {transformers.__version__} has no {config}")
    if hf and config and not expert_keys(getattr(transformers, config)()):
        pytest.skip(f"hf_plan: this transformers ships {config}'s plans without its experts")


def _generate_case(kind, ep, cache):
    """``model.generate`` (greedy, 4 new tokens after a prompt of 4, a ``cache`` "dynamic" or "static" KV cache) on
    the model parallelized by hf_plan's decode plan (``ep``: expert parallel): every step's logits against the
    unmodified model's in float64 on the generated sequence (teacher forced), for the first prompt whose sequence
    routes without near ties. On a GPU a static cache makes transformers compile the decode steps (torch.compile's
    "reduce-overhead": CUDA graphs), the styles' custom ops inside."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import hf_plan

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        model = _model(kind, W, torch.bfloat16).to(dev)
        reference = copy.deepcopy(model).double()
        parallelize_module(model, init_device_mesh(dev.type, (W,)),
                           hf_plan(model, ctx, fallback="never", sequence_parallel=False, expert_parallel=ep))
        for seed in range(20):
            prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(seed)).to(dev)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                                 use_cache=True, cache_implementation=cache, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            ctx.check()
            assert out.sequences.shape == (2, 8) and len(out.logits) == 4
            if _routes_decisively(reference, out.sequences):  # (the same sequences on every rank)
                break
        else:
            raise AssertionError("no prompt's generated sequence routes without near ties")
        # transformers compiles the decode steps (mode "reduce-overhead": CUDA graphs) where the cache is static on a
        # GPU, and keeps the compiled call (a private attribute of its models)
        assert hasattr(model, "_compiled_call") == (dev.type == "cuda" and cache == "static")
        err = rel_err(torch.stack(out.logits, 1), reference(out.sequences).logits[:, 3:-1].detach())
        assert err < TOL_LOGITS, f"rank {ctx.rank}: logits rel err {err:.2e}"
        return err


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("case", [("mixtral", False), ("glm4", True), ("deepseek_v3", False), ("qwen3_5_moe", False),
                                  ("gpt_oss", False)],
                         ids=["mixtral", "glm4_ep", "deepseek_v3", "qwen3_5_moe", "gpt_oss"])
def test_generate_with_the_decode_plan(pool, case, cache):
    _skip_unshipped(pytest.importorskip("transformers"), case[0])
    if pool.world != 2:
        pytest.skip("W = 2")
    if pool.backend == "host" and (case[0], cache) not in (("deepseek_v3", "static"), ("gpt_oss", "dynamic")):
        pytest.skip("the host backend runs DeepSeek-V3 with a static cache and GPT-OSS with a dynamic one (CI time); "
                    "GPUs every case")
    pool.run(_generate_case, *case, cache)


#: kind -> experts + shared parts
BLOCKS = {"qwen3_next": 8, "qwen3_5_moe": 8, "deepseek_v3": 8, "olmoe": 4, "minimax_m2": 4, "deepseek_v2": 8,
          "granitemoe": 4, "ernie4_5_moe": 8, "gpt_oss": 4}


def _block(kind, W):
    """A Qwen3-Next ("qwen3_next") or Qwen3.5-MoE ("qwen3_5_moe") sparse-MoE block with a gated shared expert four
    times an expert's width, DeepSeek-V3's ("deepseek_v3": 2 groups of 2 experts, one kept, a random correction
    bias, weights scaled by 2.5, an ungated shared expert four times an expert's width) or OLMoE's ("olmoe":
    softmax top-k without renormalization, no shared expert), MiniMax-M2's ("minimax_m2": sigmoid top-k, the
    block's random correction bias passed to the router), DeepSeek-V2's ("deepseek_v2": softmax top-k within the
    best of 2 groups of 2 experts, weights scaled by 16, an ungated shared expert four times an expert's width) or
    Granite-MoE's ("granitemoe": the router named ``router``) or Ernie 4.5's ("ernie4_5_moe": softmax top-k plus a
    random correction bias, a parameter of the router's child; an ungated shared expert four times an expert's
    width) or GPT-OSS's ("gpt_oss": a router with a bias, experts with biases, gate and up interleaved, the clamped
    activation, whose limit the draws cross; the block returns a pair); 4 experts, top-2; weights rounded to bf16,
    the same on every rank."""
    small = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * W,
                 shared_expert_intermediate_size=32 * W, experts_implementation="eager")
    if kind == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
        small = dict(hidden_size=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * W,
                     n_shared_experts=4, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     experts_implementation="eager")
    elif kind == "olmoe":
        from transformers import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
        small = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, intermediate_size=8 * W,
                     norm_topk_prob=False, experts_implementation="eager")
    elif kind == "deepseek_v2":
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block
        small = dict(hidden_size=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * W,
                     n_shared_experts=4, n_group=2, topk_group=1, topk_method="group_limited_greedy",
                     routed_scaling_factor=16.0, experts_implementation="eager")
    elif kind == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig as Config
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock as Block
        small = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * W,
                     moe_num_shared_experts=4, experts_implementation="eager")
    elif kind == "granitemoe":
        from transformers import GraniteMoeConfig as Config
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE as Block
        small = dict(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8 * W,
                     experts_implementation="eager")
    elif kind == "minimax_m2":
        from transformers import MiniMaxM2Config as Config
        from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock as Block
        small = dict(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8 * W,
                     experts_implementation="eager")
    elif kind == "qwen3_next":
        from transformers import Qwen3NextConfig as Config
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
    elif kind == "gpt_oss":
        from transformers import GptOssConfig as Config
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
        small = dict(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8 * W,
                     swiglu_limit=2.5, experts_implementation="eager")
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
    torch.manual_seed(1)
    block = Block(Config(**small))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_((torch.randn_like(p) * 0.2).bfloat16().float())
        for b in block.buffers():  # DeepSeek-V3's correction bias
            b.copy_(torch.randn_like(b) * 0.1)
    return block


CLAMP_MARGIN = 0.02  # bf16 rounding moves GPT-OSS's gate/up values by ~0.4 %: ~0.01 near a limit of 2.5


def _clamps_decisively(experts, x) -> bool:
    """Whether GPT-OSS's ``experts`` clamp some gate or up value of rows ``x`` [T, dim] (at every expert) and none
    lies within CLAMP_MARGIN of the limit: the clamp's gradient is 0 past it and 1 before, so a value that bf16
    rounding moves across the limit changes its gradient by its whole size."""
    h = torch.einsum("td,edn->ten", x, experts.gate_up_proj.double()) + experts.gate_up_proj_bias.double()
    gate, up = h[..., 0::2], h[..., 1::2].abs()
    limit = experts.limit
    near = ((gate - limit).abs() < CLAMP_MARGIN).any() or ((up - limit).abs() < CLAMP_MARGIN).any()
    return bool(not near and ((gate > limit).any() or (up > limit).any()))


def _block_case(kind, decode=False, ep=False):
    """The block alone, parallelized by MoEParallel, against itself unsharded in float64 on tokens [2, 4W, 32]
    routed without near ties: this rank's output and input gradient, every parameter's gradient. ``decode``:
    without sequence parallelism (every token on every rank, the whole output); ``ep``: expert parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import MoEParallel, overlap_ops

    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        block = _block(kind, W).to(dev)
        reference = copy.deepcopy(block).double()
        B, S, s = 2, 4 * W, 4
        pair = kind == "gpt_oss"  # (its block returns (output, the router's top-k scores))
        first = (lambda o: o[0]) if pair else (lambda o: o)  # noqa: E731
        for seed in range(1000):  # the first draw whose top-2 choice has no near tie (_decisive_tokens)
            x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(seed)).bfloat16().double().to(dev)
            gate = getattr(reference, "gate", None) or reference.router  # (Granite-MoE's is "router")
            logits = nn.functional.linear(x, gate.weight, getattr(gate, "bias", None))  # (GPT-OSS's: a bias)
            if _decisive(gate, logits.view(B * S, -1), getattr(reference, "e_score_correction_bias", None)) and \
                    (not pair or _clamps_decisively(reference.experts, x.view(B * S, -1))):
                break
        gy = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(7)).double().to(dev)
        x_ref = x.clone().requires_grad_()
        (first(reference(x_ref)) * gy).sum().backward()
        unmodified = {k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in block.state_dict().items()}
        parallelize_module(block.bfloat16(), init_device_mesh(dev.type, (W,)),
                           MoEParallel(ctx, fallback="never", sequence_parallel=not decode, expert_parallel=ep))
        check_full_state_dict(block, unmodified)
        check_sharded_checkpoint(block, unmodified, shards=False)  # (the experts: gathered)
        mine = slice(0, S) if decode else slice(r * s, (r + 1) * s)
        x_local = x[:, mine].bfloat16().requires_grad_()
        out = block(x_local)
        if pair:  # this rank's tokens' top-k weights, as the block's router scores them
            assert isinstance(out, tuple) and len(out) == 2, type(out)
            scores, ref_scores = out[1], reference(x)[1].view(B, S, -1)[:, mine].reshape(out[1].shape)
            assert rel_err(scores.sort(-1).values, ref_scores.sort(-1).values) < TOL_LOGITS
            out = out[0]
        assert isinstance(out, DTensor) != decode
        out = out if decode else out.to_local()
        assert out.shape == x_local.shape
        (out.float() * gy[:, mine].float()).sum().backward()
        ctx.check()
        errs = {"out": rel_err(out.detach(), first(reference(x))[:, mine].detach()),
                "grad_x": rel_err(x_local.grad, x_ref.grad[:, mine]),
                **_grad_errors(block, reference, r, W, ep)}
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > (TOL_LOGITS if k == "out" else TOL_GRAD)}
        assert not bad, f"rank {r}: {bad}"
        check_grad_clipping(block, reference, lambda: _grad_errors(block, reference, r, W, ep), TOL_GRAD)
        shape = (4 // W, 32, 16 * W) if ep else (BLOCKS[kind], 32, 16)
        assert block.last_path == "overlap" and tuple(block.experts.gate_up_proj.shape) == shape
        assert [type(op).__name__ for op in overlap_ops(block)] == (
            ["AllReduce"] if decode else ["ExpertParallel"] if ep else ["AllGatherMoEGEMM", "MoEGEMMReduceScatter"])
        return max(errs.items(), key=lambda kv: kv[1])


#: (kind, decode, expert parallel): every block tensor + sequence parallel; DeepSeek-V3's (grouped routing, an
#: ungated shared expert) and Qwen3-Next's (a gated shared expert) also without sequence parallelism, tensor and
#: expert parallel; MiniMax-M2's (the block's correction bias) without sequence parallelism, tensor parallel
BLOCK_CASES = [(kind, False, False) for kind in BLOCKS] + [
    ("deepseek_v3", True, False), ("deepseek_v3", True, True), ("qwen3_next", True, True),
    ("minimax_m2", True, False), ("gpt_oss", True, False), ("gpt_oss", True, True), ("gpt_oss", False, True)]


@pytest.mark.parametrize("case", BLOCK_CASES,
                         ids=lambda c: c[0] + ("_decode" if c[1] else "") + ("_ep" if c[2] else ""))
def test_moe_block_matches_unmodified_block(pool, case):
    kind, decode, ep = case
    pytest.importorskip(f"transformers.models.{kind}")
    if pool.world == 4 or (ep and pool.world != 2):
        pytest.skip("W = 2, 3 on the host backend; expert parallel: the 4 experts split over W = 2")
    if pool.backend == "host" and decode and (pool.world == 3 or kind not in ("deepseek_v3", "gpt_oss") or ep):
        pytest.skip("the host backend runs DeepSeek-V3's and GPT-OSS's tensor-parallel decode blocks at W = 2 (CI "
                    "time); GPUs every case")
    pool.run(_block_case, kind, decode, ep)


def _compiled_decode_block(ep):
    """DeepSeek-V3's block without sequence parallelism (tensor or expert parallel) under
    ``torch.compile(fullgraph=True)``: one graph (a break raises), its output within bf16 rounding of the eager
    block's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import MoEParallel

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        block = _block("deepseek_v3", W).to(dev)
        parallelize_module(block.bfloat16(), init_device_mesh(dev.type, (W,)),
                           MoEParallel(ctx, fallback="never", sequence_parallel=False, expert_parallel=ep))
        x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
        with torch.no_grad():
            want = block(x)
            got = torch.compile(block, fullgraph=True)(x)
        ctx.check()
        err = rel_err(got, want)
        assert err < TOL_LOGITS, f"rank {ctx.rank}: {err:.2e}"
        return err


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_decode_block_compiles_to_one_graph(pool, ep):
    pytest.importorskip("transformers.models.deepseek_v3")
    if pool.world != 2 or (pool.backend == "host" and not ep):
        pytest.skip("W = 2; the host backend the expert-parallel block (CI time)")
    pool.run(_compiled_decode_block, ep)


def _decode_replays(ep, steps):
    """DeepSeek-V3's block without sequence parallelism (tensor or expert parallel), batch 4 of one token, captured
    once in a CUDA graph and replayed on new tokens: each replay against the unsharded block in float32, the
    output poisoned before every replay."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refs import check_decode_replays
    from triton_overlap.nn import MoEParallel

    with to.Context(timeout_s=30) as ctx:
        W, dev = ctx.world_size, ctx.device
        block = _block("deepseek_v3", W).to(dev)
        reference = copy.deepcopy(block)
        parallelize_module(block.bfloat16(), init_device_mesh(dev.type, (W,)),
                           MoEParallel(ctx, fallback="never", sequence_parallel=False, expert_parallel=ep))
        check_decode_replays(block, reference, torch.empty(4, 1, 32, device=dev, dtype=torch.bfloat16), steps)
        ctx.check()
        assert block.last_path == "overlap"
        return True


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_decode_block_replays_in_cuda_graph(pool, ep):
    pytest.importorskip("transformers.models.deepseek_v3")
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    if ep and pool.world != 2:
        pytest.skip("expert parallel: the 4 experts split over W = 2")
    assert all(pool.run(_decode_replays, ep, 50))


def _refusals():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from triton_overlap.nn import MoEParallel
    from triton_overlap.nn.routers import GroupedSigmoid, Softmax

    with to.Context(timeout_s=60) as ctx:
        W, dev = ctx.world_size, ctx.device
        mesh = init_device_mesh(dev.type, (W,))
        small = dict(hidden_size=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * W)
        with pytest.raises(ValueError, match="fallback"):
            MoEParallel(ctx, fallback="sometimes")
        with pytest.raises(ValueError, match="shared expert's width 8 is not a multiple of the experts' width"):
            parallelize_module(Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(shared_expert_intermediate_size=8, **small)),
                               mesh, MoEParallel(ctx))
        gelu = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(shared_expert_intermediate_size=16 * W, **small))
        with torch.no_grad():
            for p in gelu.parameters():
                p.normal_()
        gelu.shared_expert.act_fn = torch.nn.GELU()
        with pytest.raises(TypeError, match=r"does not compute down\(silu"):
            parallelize_module(gelu, mesh, MoEParallel(ctx))
        del gelu.shared_expert_gate
        with pytest.raises(TypeError, match=r"without \['shared_expert_gate'\]"):
            parallelize_module(gelu, mesh, MoEParallel(ctx))
        renamed = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small))  # a router is taken by its rule, not its name
        renamed.gate.__class__ = type("RenamedRouter", (type(renamed.gate),), {})
        parallelize_module(renamed, mesh, MoEParallel(ctx))
        assert renamed.gate.tp_rule == Softmax(bool(renamed.gate.norm_topk_prob))

        def halved(gate, rows):  # softmax top-k, the weights halved: no rule of nn.routers
            logits, weights, ids = type(gate).__mro__[1].forward(gate, rows)
            return logits, weights / 2, ids

        other = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small))
        other.gate.__class__ = type("HalvingRouter", (type(other.gate),), {"forward": halved})
        with pytest.raises(TypeError, match="router HalvingRouter computes none of the rules"):
            parallelize_module(other, mesh, MoEParallel(ctx))
        try:  # MiniMax-M2's router takes the block's correction bias as a second argument
            from transformers.models.minimax_m2 import modeling_minimax_m2 as minimax
        except ImportError:
            minimax = None
        if minimax is not None:
            block = minimax.MiniMaxM2SparseMoeBlock(minimax.MiniMaxM2Config(**{**small, "num_local_experts": 4}))
            parallelize_module(block, mesh, MoEParallel(ctx))
            assert block.gate.tp_rule == GroupedSigmoid(renormalize=True) and block.tp_router_bias
            plain = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small))  # a router of two arguments, no bias: refused
            plain.gate.__class__ = type("TwoArgumentRouter", (type(plain.gate),), {
                "forward": lambda gate, rows, scale: type(gate).__mro__[1].forward(gate, rows * scale)})
            with pytest.raises(TypeError, match="router TwoArgumentRouter's forward on rows"):
                parallelize_module(plain, mesh, MoEParallel(ctx))
        odd = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**{**small, "moe_intermediate_size": 8 * W + 1}))
        with pytest.raises(ValueError, match="not divisible"):
            parallelize_module(odd, mesh, MoEParallel(ctx))
        parallelize_module(odd, mesh, MoEParallel(ctx, expert_parallel=True))  # whole experts: any width
        three = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**{**small, "num_experts": 2 * W + 1}))
        with pytest.raises(ValueError, match=rf"the {2 * W + 1} experts are not divisible by the world size {W}"):
            parallelize_module(three, mesh, MoEParallel(ctx, expert_parallel=True))
        block = parallelize_module(Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small)), mesh, MoEParallel(ctx))
        with pytest.raises(ValueError, match="parallelized already"):
            parallelize_module(block, mesh, MoEParallel(ctx))
        with pytest.raises(TypeError, match="bfloat16 or float16.*autocast"):  # float32 parameters, no autocast
            block(torch.randn(1, 2, 16, device=dev))
        from torch.distributed.tensor import DTensor, Shard
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        jitter = MixtralSparseMoeBlock(MixtralConfig(hidden_size=16, num_local_experts=4, intermediate_size=8 * W,
                                                     router_jitter_noise=0.1)).bfloat16().to(dev)
        parallelize_module(jitter, mesh, MoEParallel(ctx, sequence_parallel=False))
        x = torch.randn(1, 2 * W, 16, device=dev, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="router jitter"):  # each rank would draw its own noise
            jitter.train()(x)
        with pytest.raises(ValueError, match=r"placed \(Shard\(dim=1\),\); expected Replicate"):
            jitter.eval()(DTensor.from_local(x, mesh, [Shard(1)], run_check=False))
        assert jitter(x).shape == x.shape  # evaluation: no jitter
        try:
            from transformers import GptOssConfig, GptOssForCausalLM
        except ImportError:
            GptOssConfig = None
        if GptOssConfig is not None:  # attention with sinks whose 3 heads do not split over the ranks
            from triton_overlap.nn import hf_plan

            gpt = GptOssForCausalLM(GptOssConfig(
                vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1,
                head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8 * W))
            with pytest.raises(ValueError, match=r"hf_plan: model.layers.0.self_attn: SinkAttentionParallel: "
                                                 rf"GptOssAttention's 3 query and 1 key/value heads are not divisible "
                                                 rf"by the world size {W}"):
                hf_plan(gpt, ctx)
        ctx.check()
        return True


def test_moe_parallel_refuses_what_it_cannot_run(pool):
    pytest.importorskip("transformers")
    if pool.world != 2:
        pytest.skip("W = 2")
    assert all(pool.run(_refusals))
