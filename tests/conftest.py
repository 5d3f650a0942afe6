"""Pools of ranks per (backend, world size); see harness.py. And the test tiers.

TRITON_OVERLAP_TEST_BACKENDS picks the configurations, e.g. "host:2,host:3,host:4,cuda:2"
(the default). GPU configurations skip where the machine has fewer GPUs. "cuda-shared:W" runs W ranks on one
GPU (harness.py): the cuda backend's protocol checked where only one GPU is lent, slowly, and never timed.

Tiers: ``python -m pytest`` on the whole suite runs the fast tier, the tests and cases listed in FAST below (each
marked ``fast``; the rest are deselected, and the summary counts them). Every case runs with ``--full`` or
TRITON_OVERLAP_TEST_TIER=full, where TRITON_OVERLAP_TEST_BACKENDS names a GPU backend, and where the command
names test files or tests (``python -m pytest tests/test_faults.py``). TRITON_OVERLAP_TEST_TIER=fast takes the fast
tier's cases of whatever is named.
"""
import os
import sys

import pytest

# FP fusion on, as every Triton up to 3.9 compiles by default and as the kernels were measured; set explicitly so
# that Triton 3.9 does not warn that its default changes in 3.10 (the pools' processes inherit it)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import get_pool, gpu_count  # noqa: E402

BACKENDS_ENV = "TRITON_OVERLAP_TEST_BACKENDS"
TIER_ENV = "TRITON_OVERLAP_TEST_TIER"


def _configs():
    spec = os.environ.get(BACKENDS_ENV, "host:2,host:3,host:4,cuda:2")
    out = []
    for item in spec.split(","):
        backend, world = item.strip().split(":")
        out.append((backend, int(world)))
    return out


CONFIGS = _configs()


# The host backend at W = 4 runs these tests only (test ids under tests/: a file or a test): the Context, the faults,
# AllReduce (its two-shot's power-of-two split) and the ops between two hosts of two (test_topology, which runs the
# dense, attention, MoE and EP ops' cases there), and tensor (and expert) parallel beside FSDP2 on a 2 x 2 mesh. Four
# ranks of interpreted kernels outnumber a CI machine's two cores, and the rest of the suite at W = 4 took a third of
# CI's time. W = 2 and 3 run the rest (W = 3 with the cuts docs/testing.md lists), and every GPU world every test.
HOST_W4 = ["test_context.py", "test_faults.py", "test_topology.py", "test_all_reduce.py",
           "test_parallel_styles.py::test_tensor_parallel_beside_fsdp", "test_parallel_moe.py::test_moe_beside_fsdp",
           "test_checkpoints.py::test_from_full_layers_beside_fsdp"]


def _listed(nodeid: str, entry: str) -> bool:
    """Whether test id ``nodeid`` (under tests/) is ``entry``: a file, a test (every case) or one case."""
    return nodeid == entry or nodeid.startswith(entry + ("::" if entry.endswith(".py") else "["))


@pytest.fixture(params=CONFIGS, ids=[f"{b}-w{w}" for b, w in CONFIGS])
def pool(request):
    backend, world = request.param
    if backend == "host" and world >= 4:
        nodeid = request.node.nodeid.removeprefix("tests/")
        if not any(_listed(nodeid, e) for e in HOST_W4):
            pytest.skip("the host backend at W = 4 runs the tests in tests/conftest.py HOST_W4 only (CI time)")
    if backend in ("cuda", "hip") and gpu_count() < world:
        pytest.skip(f"needs {world} GPUs")
    if backend == "cuda-shared" and gpu_count() < 1:
        pytest.skip("needs a GPU")
    return get_pool(backend, world)


# The fast tier: every op, the fault paths and the first tutorial on the host backend at W = 2 and 3, and the
# pure-CPU rules and checks. An entry is a test id under tests/: a file (every test in it), a test (every case) or
# one case. Each entry must name something the suite has: a renamed test fails the fast tier's collection.
FAST = [
    # AllGather-GEMM, fp8 included (the host backend runs odd-numbered cases at W = 3)
    "test_ag_gemm.py::test_ag_gemm_matches_reference[host-w2-0]",
    "test_ag_gemm.py::test_ag_gemm_matches_reference[host-w3-3]",
    "test_ag_gemm.py::test_ag_gemm_fp8_matches_reference[host-w2-0]",
    "test_ag_gemm.py::test_ag_gemm_fp8_matches_reference[host-w3-1]",
    "test_ag_gemm.py::test_ag_gemm_bad_input_raises_before_launch[host-w2]",
    "test_ag_gemm.py::test_chunk_rows_rule",
    "test_ag_gemm.py::test_descriptor_rule",
    "test_ag_gemm.py::test_eager_rule_thresholds",
    "test_ag_gemm.py::test_gluon_rule",
    "test_ag_gemm.py::test_gather_a_planes",
    "test_ag_gemm.py::test_pull_gates_the_consumer",
    # GEMM-ReduceScatter
    "test_gemm_rs.py::test_gemm_rs_matches_reference[host-w2-0]",
    "test_gemm_rs.py::test_gemm_rs_100_back_to_back_calls[host-w2-store]",
    "test_gemm_rs.py::test_one_wave_rule",
    "test_gemm_rs.py::test_scatter_auto_rule",
    "test_gemm_rs.py::test_warp_specialized_rule",
    "test_gemm_rs.py::test_rs_chunks_carry_min_chunk_bytes",
    # context-parallel attention, forward and backward
    "test_cp_attention.py::test_cp_attention_matches_full_sequence[host-w2-0]",
    "test_cp_attention.py::test_cp_attention_matches_full_sequence[host-w3-1]",
    "test_cp_attention.py::test_cp_attention_gradients_match_full_sequence[host-w2-0]",
    "test_cp_attention.py::test_forward_wait_times_out[host-w2]",
    "test_cp_attention.py::test_backward_wait_times_out[host-w2]",
    "test_cp_attention.py::test_head_split_choice",
    "test_cp_attention.py::test_heads_interleaved_choice",
    "test_cp_attention.py::test_tail_heads_choice",
    "test_cp_attention.py::test_tail_split_choice",
    "test_cp_attention.py::test_warp_groups_choice",
    "test_cp_attention.py::test_packed_tables_are_bounded_and_ordered",
    # AllReduce, GEMM + AllReduce, AllReduce + residual + RMSNorm
    "test_all_reduce_rmsnorm.py::test_all_reduce_rmsnorm_matches_reference[host-w2-3]",
    "test_all_reduce_rmsnorm.py::test_all_reduce_rmsnorm_bad_input_raises_before_launch[host-w2]",
    "test_all_reduce.py::test_sums[host-w2-never-one_shot]",
    "test_all_reduce.py::test_sums[host-w3-never-two_shot]",
    "test_all_reduce.py::test_consecutive_calls_never_share_slots",
    "test_all_reduce.py::test_one_shot_tiling_keeps_every_program_resident",
    # decode's local product
    "test_skinny_gemm.py::test_skinny_gemm_matches_reference[host-w2]",
    "test_skinny_gemm.py::test_rule",
    "test_gemm_all_reduce.py::test_decode_tiles_rule",
    "test_all_reduce.py::test_peer_absent[host-w3]",
    "test_gemm_all_reduce.py::test_gemm_ar[host-w2-fused-never]",
    "test_gemm_all_reduce.py::test_gemm_ar[host-w3-two_shot-never]",
    "test_gemm_all_reduce.py::test_row_parallel_without_sequence_parallel[host-w2]",
    # MoE tensor-parallel: AllGather + grouped GEMM, grouped GEMM + combine + ReduceScatter
    "test_moe.py::test_ag_moe_gemm_matches_reference[host-w2-0]",
    "test_moe.py::test_ag_moe_gemm_matches_reference[host-w3-5]",
    "test_moe.py::test_moe_gemm_rs_matches_reference[host-w2-0]",
    "test_moe.py::test_moe_gemm_rs_matches_reference[host-w3-3]",
    "test_moe.py::test_ag_moe_gemm_bad_input_raises_before_launch[host-w2]",
    "test_moe.py::test_moe_gemm_rs_bad_input_raises_before_launch[host-w3]",
    "test_moe.py::test_sorted_layout_feeds_moe_gemm_rs[host-w2-never]",
    "test_moe.py::test_ag_moe_wait_times_out[host-w2]",
    # (the routing kernels against torch, 30 s and 36 s on 2 cores, run in the full tier; the ops' cases here
    # run those kernels end to end)
    "test_moe_routing.py::test_routing_orders_tiles[host-w2]",
    "test_moe_routing.py::test_tile_table_reference_bounds_and_covers",
    "test_moe.py::test_fallback_rule",
    "test_moe.py::test_rank_runs",
    # MoE expert-parallel: dispatch and combine at W = 3 (an empty rank, fp16), bad input, a peer that never sends
    "test_expert_parallel.py::test_ep_matches_reference[host-w3-1]",
    "test_expert_parallel.py::test_ep_bad_input_raises_before_launch[host-w2]",
    "test_expert_parallel.py::test_ep_silent_peer_faults[host-w2-rows]",
    "test_expert_parallel.py::test_ep_fp8_dispatch_moves_rows_and_scales[host-w2]",
    "test_ep_low_latency.py::test_ep_low_latency_matches_reference[host-w2]",
    # the nn layers and the block
    "test_nn.py::test_linear_layers_match_unsharded_module[host-w2-never-True]",
    "test_nn.py::test_linear_layers_match_unsharded_module[host-w3-never-False]",
    "test_nn.py::test_tp_mlp_follows_single_process_loss_curve[host-w2-never]",
    "test_nn.py::test_layers_reject_unshardable_features[host-w2]",
    "test_nn.py::test_weight_gradients_come_out_in_the_weights_layout",
    "test_block.py::test_block_matches_full_sequence[host-w2-False]",
    # the MoE layer; parallel styles in an unmodified Hugging Face Llama; the benchmarks' model and MoE pieces
    "test_nn_moe.py::test_tp_moe_matches_plain_module[host-w2-bf16]",
    "test_nn_moe.py::test_tp_moe_matches_plain_module[host-w3-empty_experts]",
    "test_nn_moe.py::test_tp_moe_matches_plain_module[host-w2-autocast]",
    "test_nn_moe.py::test_tp_moe_refuses_what_it_cannot_run[host-w2]",
    "test_nn_ep_moe.py::test_ep_moe_matches_plain_module[host-w3-empty_experts]",
    "test_parallel_styles.py::test_llama_matches_unmodified_model[host-w2-0]",
    "test_parallel_styles.py::test_llama_matches_unmodified_model[host-w2-2]",
    "test_parallel_styles.py::test_llama_matches_unmodified_model[host-w2-4]",
    "test_parallel_styles.py::test_shared_input_colwise[host-w3-2]",
    "test_parallel_styles.py::test_float32_needs_autocast_and_styles_check_their_input[host-w2]",
    "test_parallel_styles.py::test_from_full_rejects_unknown_keywords",
    "test_parallel_styles.py::test_hf_plan_from_the_models_own",
    "test_parallel_moe.py::test_moe_model_matches_unmodified_model[host-w2-0]",
    "test_parallel_moe.py::test_moe_parallel_refuses_what_it_cannot_run[host-w2]",
    "test_parallel_moe.py::test_moe_block_matches_unmodified_block[host-w2-deepseek_v3_decode_ep]",
    "test_moe_bench.py::test_routings_are_seeded_distinct_and_skewed_as_named",
    "test_ep_bench.py::test_report_writes_table_summary_and_what_it_did_not_measure",
    # faults: one case of each kind
    "test_faults.py::test_peer_absent[host-w2-first_call]",
    "test_faults.py::test_peer_absent[host-w3-repeated_call_pull]",
    "test_faults.py::test_shapes_disagree[host-w2-first]",
    "test_faults.py::test_shapes_disagree[host-w3-repeated]",
    "test_faults.py::test_shapes_disagree[host-w3-mixed]",
    "test_faults.py::test_one_rank_refuses_its_input[host-w3-first]",
    "test_faults.py::test_relay_meeting_own_fault_reads_as_own[host-w2-mismatch]",
    "test_faults.py::test_relay_meeting_own_fault_reads_as_own[host-w2-bad_ids]",
    "test_faults.py::test_timeout_then_reset_then_correct_calls[host-w2]",
    "test_faults.py::test_close_on_one_rank_only[host-w2]",
    "test_faults.py::test_empty_inputs_raise_before_any_collective[host-w3]",
    "test_faults.py::test_rank_killed[mid_call]",
    # the Context, hosts, replay rules
    "test_context.py::test_peer_visibility[host-w2]",
    "test_context.py::test_flag_never_seen_before_data[host-w3-0.002]",
    "test_context.py::test_expired_wait_raises_and_reset_restores_the_context[host-w2]",
    "test_context.py::test_expired_waits_name_what_they_waited_for[host-w3]",
    "test_context.py::test_mismatched_collective_arguments_raise_everywhere[host-w2]",
    "test_topology.py::test_across_hosts[host-w2-2]",
    "test_topology.py::test_across_hosts[host-w3-3]",
    "test_topology.py::test_ops_between_hosts[host-w2-ag push]",
    "test_topology.py::test_faults_between_hosts[host-w2-peer absent]",
    "test_topology.py::test_topology_from_keys",
    "test_topology.py::test_tile_orders_between_hosts",
    "test_replay.py::test_replay_off_on_host_backend_and_with_jitter",
    "test_replay.py::test_replay_decisions",
    "test_replay.py::test_replay_hit",
    "test_replay.py::test_replay_counts_calls_sent_to_nccl",
    "test_replay.py::test_replay_unprepared_after_a_new_generation",
    # tuning tables, reports, the repository, entry points, the Gluon kernels' compilation, the first tutorial
    "test_tuning.py::test_lookup_prefers_world_size_then_any_then_nearest",
    "test_tuning.py::test_the_shipped_table_is_read",
    "test_tuning.py::test_tiles_only_entry_keeps_the_ops_other_defaults",
    "test_tuning.py::test_tune_tiles_only_dry_run_writes_an_any_entry[ag_gemm_fp8]",
    "test_control.py",
    "test_report.py",
    "test_repository.py",
    "test_entry_points.py::test_launcher_help",
    "test_entry_points.py::test_script_without_the_launcher_says_how_to_start_it",
    "test_entry_points.py::test_auto_backend_follows_the_interpreter",
    "test_compile.py::test_gluon_kernel_compiles_for_hopper[compile_warp_specialized]",
    "test_compile.py::test_gluon_kernel_compiles_for_hopper[compile_gather_hopper]",
    "test_tutorials.py::test_tutorial_passes_on_host_backend[01_context_and_signals.py]",
    "test_checkpoints.py::test_even_slices_undo_the_transposes_in_order",
]


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run every test and case, not the fast tier (also: TRITON_OVERLAP_TEST_TIER=full)")


def _whole_suite(config) -> bool:
    """Whether the command names no test file or test: the suite as collected from testpaths or tests/."""
    for arg in config.args:
        path = os.path.abspath(os.path.join(str(config.invocation_params.dir), arg.split("::")[0]))
        if path not in (HERE, os.path.dirname(HERE)):
            return False
    return True


def _tier(config) -> tuple[str, str]:
    """("fast" or "full", why)."""
    if config.getoption("--full"):
        return "full", "--full"
    env = os.environ.get(TIER_ENV, "")
    if env:
        if env not in ("fast", "full"):
            raise pytest.UsageError(f"{TIER_ENV}={env!r}: expected fast or full")
        return env, f"{TIER_ENV}={env}"
    if BACKENDS_ENV in os.environ and any(b != "host" for b, _ in CONFIGS):
        return "full", f"{BACKENDS_ENV} names a GPU backend"
    if not _whole_suite(config):
        return "full", "tests named on the command line"
    return "fast", "the default; --full runs every case"


def pytest_configure(config):
    config._triton_overlap_tier = _tier(config)


@pytest.hookimpl(tryfirst=True)  # before -k and -m, which then select among the tier's tests
def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        hit = next((e for e in FAST if _listed(item.nodeid.removeprefix("tests/"), e)), None)
        if hit is not None:
            item.add_marker(pytest.mark.fast)
            used.add(hit)
    tier, _ = config._triton_overlap_tier
    if tier != "fast":
        return
    if _whole_suite(config) and BACKENDS_ENV not in os.environ:  # the default configurations have every entry
        missing = [e for e in FAST if e not in used]
        if missing:
            raise pytest.UsageError("tests/conftest.py FAST names tests the suite does not have: " + ", ".join(missing))
    keep = [item for item in items if item.get_closest_marker("fast")]
    dropped = [item for item in items if not item.get_closest_marker("fast")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_report_header(config):
    tier, why = config._triton_overlap_tier
    return f"triton_overlap test tier: {tier} ({why})"
