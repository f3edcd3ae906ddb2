from __future__ import annotations

from dataclasses import replace

import pytest

from deepserve.errors import ConfigError
from deepserve.models import load_spec
from deepserve.plan.layout import Layout
from deepserve.plan.perf import (
    RankLoad,
    RequestLengths,
    StepCost,
    StepOptions,
    expected_distinct_experts,
    expected_max_poisson,
)
from deepserve.plan.planner import build_deployment
from deepserve.plan.profiles import EngineParameters, SelectedFactors
from deepserve.plan.speculative import acceptance_from_length, speculative_decoding
from deepserve.plan.types import Deployment

AWQ = "cognitivecomputations/DeepSeek-V3-AWQ"
# Round numbers so the hand computations below are easy to follow; the fitted values live in engine_profiles.json.
PARAMETERS = EngineParameters(kernels_per_layer=20.0, prefill_efficiency=0.5)


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


@pytest.fixture(scope="module")
def awq():
    return load_spec(AWQ)


def _engine_with(deployment: Deployment, parameters: EngineParameters) -> SelectedFactors:
    """DEPLOYMENT's own engine profile with PARAMETERS in place of its fitted ones."""
    selected = deployment.select_engine()
    assert selected is not None  # across_engines=True always finds the device's profile
    return selected.with_parameters(parameters)


def _model(spec, gpu="h200", gpus=8, weights="fp8", parameters=PARAMETERS, **kwargs):
    deployment = build_deployment(spec, gpu, gpus, weights=weights, **kwargs)
    return deployment, deployment.performance_model(_engine_with(deployment, parameters))


def test_expected_distinct_experts_hand_values() -> None:
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 2) == pytest.approx(256 * (1 - (248 / 256) ** 2))  # 15.75
    assert expected_distinct_experts(256, 8, 64) == pytest.approx(256 * (1 - (1 - 1 / 32) ** 64))
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert expected_distinct_experts(0, 0, 5) == 0


def test_single_token_decode_is_memory_bound_and_large_prefill_compute_bound(v3) -> None:
    _, model = _model(v3)
    decode = model.step(1, 0, 2048)
    assert decode.kind("dense_gemm").memory_s > decode.kind("dense_gemm").compute_s
    assert decode.kind("mla_decode").bound in ("memory", "launch")
    prefill = model.step(0, 8192, 0)
    assert prefill.kind("dense_gemm").bound == "compute"
    assert prefill.kind("moe_gemm").bound == "compute"


def test_decode_step_by_hand(v3) -> None:
    """At batch 1 a GPU reads its shard of attention, dense and shared weights and the output head (dense GEMMs),
    8 experts per MoE layer, and one token's latent cache on every layer; each at the kernel table's fraction of
    H200's 4.8 TB/s, plus the kinds' floors and the engine's small kernels."""
    _deployment, model = _model(v3)
    step = model.step(1, 0, 1000)
    rates = model.rates
    parts = v3.parameter_breakdown()
    fp8 = 1 + 4 / 128**2
    static = (
        parts["attention_latent"] * fp8
        + (parts["attention_heads"] + parts["dense_mlp"] + parts["shared_experts"]) * fp8 / 8
        + (parts["norms"] + parts["router"]) * 2
        - v3.hidden_size * 2  # the final norm lives outside the layers
        + parts["lm_head"] * 2 / 8
    )
    bandwidth = 4800e9
    assert step.kind("dense_gemm").memory_s == pytest.approx(
        static / (bandwidth * rates.rate("dense_gemm").memory_efficiency), rel=1e-3
    )
    experts = 58 * 8 * v3.expert_params * fp8 / 8
    assert step.kind("moe_gemm").memory_s == pytest.approx(
        experts / (bandwidth * rates.rate("moe_gemm").memory_efficiency), rel=1e-3
    )
    assert step.kind("moe_gemm").floor_s == pytest.approx(58 * rates.rate("moe_gemm").floor_us * 1e-6)
    kv = 1000 * 70_272
    assert step.kind("mla_decode").memory_s == pytest.approx(
        kv / (bandwidth * rates.rate("mla_decode").memory_efficiency), rel=1e-3
    )
    launch = rates.launch_us["cuda_graph"] * 1e-6
    assert step.overhead_s == pytest.approx(61 * PARAMETERS.kernels_per_layer * launch)
    assert sum(step.breakdown_s().values()) == pytest.approx(step.total_s)


def test_prompt_gemms_run_at_the_profile_prefill_efficiency_and_attention_at_its_own(v3) -> None:
    """The engine's prefill efficiency slows the prompt's GEMMs only: attention runs at the kernel table's attention
    rate (issue 20: charging attention the GEMM path's factor made long prompts too slow)."""
    _, fast = _model(v3, parameters=EngineParameters(kernels_per_layer=20.0, prefill_efficiency=1.0))
    _, slow = _model(v3, parameters=EngineParameters(kernels_per_layer=20.0, prefill_efficiency=0.25))
    for kind in ("dense_gemm", "moe_gemm"):
        assert slow.step(0, 8192, 0).kind(kind).compute_s == pytest.approx(
            4 * fast.step(0, 8192, 0).kind(kind).compute_s
        )
    attention = slow.step(0, 8192, 0).kind("mla_prefill")
    assert attention.compute_s == pytest.approx(fast.step(0, 8192, 0).kind("mla_prefill").compute_s)
    assert slow.step(64, 0, 2000).compute_s == pytest.approx(fast.step(64, 0, 2000).compute_s)  # decode untouched


def test_chunked_prefill_reads_the_cached_context(v3) -> None:
    _, model = _model(v3)
    first = model.step(0, 2048, 0, prefill_context=0)
    later = model.step(0, 2048, 0, prefill_context=8192)
    assert first.kind("mla_prefill").memory_s == 0
    assert later.kind("mla_prefill").memory_s > 0
    assert later.kind("mla_prefill").compute_s == pytest.approx(
        first.kind("mla_prefill").compute_s * (8192 + 1024) / 1024
    )


def test_old_vllm_launches_awq_experts_one_by_one(awq) -> None:
    """vLLM before 0.8 ran AWQ MoE through a Marlin kernel that launched each touched expert's GEMMs from the host:
    the MoE floor grows with the experts a batch touches and the step pays host-synchronised launches."""
    _, old = _model(awq, gpu="h100", weights=None, engine_version="0.7.3")
    _, new = _model(awq, gpu="h100", weights=None, engine_version="0.16.0")
    assert old.launch_mode == "host_synchronised" and new.launch_mode == "cuda_graph"
    one, many = old.step(1, 0, 1000).kind("moe_gemm"), old.step(64, 0, 1000).kind("moe_gemm")
    touched = expected_distinct_experts(256, 8, 64) / 8
    assert many.floor_s == pytest.approx(one.floor_s * touched)
    assert new.step(64, 0, 1000).kind("moe_gemm").floor_s == new.step(1, 0, 1000).kind("moe_gemm").floor_s
    _, fp8_old = _model(load_spec("deepseek-ai/DeepSeek-V3"), engine_version="0.7.3")
    assert fp8_old.launch_mode == "cuda_graph"  # only the int4 MoE kernel was launched per expert


def test_tpot_grows_with_concurrency_and_throughput_saturates(v3) -> None:
    deployment, model = _model(v3)
    workload = RequestLengths(2048, 512)
    cap = deployment.running_cap
    levels = [1, 8, 32, 128, cap, 2 * cap]
    predictions = [model.predict(c, workload, cap) for c in levels]
    tpots = [p.tpot_ms for p in predictions]
    assert tpots == sorted(tpots)
    throughputs = [p.output_throughput_tok_s for p in predictions]
    assert throughputs[:5] == sorted(throughputs[:5])
    beyond = predictions[-1]
    assert beyond.running == cap
    assert beyond.output_throughput_tok_s == pytest.approx(predictions[-2].output_throughput_tok_s)
    assert beyond.ttft_ms > 2 * predictions[-2].ttft_ms  # queueing for a slot


def test_closed_loop_throughput_matches_latencies(v3) -> None:
    deployment, model = _model(v3)
    p = model.predict(16, RequestLengths(1000, 200), deployment.running_cap)
    e2e_s = (p.ttft_ms + 199 * p.tpot_ms) / 1e3
    assert p.output_throughput_tok_s == pytest.approx(16 * 200 / e2e_s, rel=1e-6)


def test_ttft_at_concurrency_one_is_a_solo_prefill_after_the_request_overhead(v3) -> None:
    """One user's TTFT: the engine's per-request overhead (issue 20: a floor of about 120-150 ms that no step
    accounts for) plus the prompt's own step."""
    parameters = EngineParameters(kernels_per_layer=20.0, prefill_efficiency=0.5, request_overhead_ms=100.0)
    deployment, model = _model(v3, parameters=parameters)
    p = model.predict(1, RequestLengths(4096, 100), deployment.running_cap)
    assert p.ttft_ms == pytest.approx(100.0 + model.step(0, 4096, 2048).total_s * 1e3)
    _, without = _model(v3)
    assert without.predict(1, RequestLengths(4096, 100), deployment.running_cap).tpot_ms == pytest.approx(p.tpot_ms)


def test_a100_is_slower_than_h100_where_the_hardware_decides(awq) -> None:
    """Same engine, format and layout: the A100 has 61% of the H100's bandwidth and 32% of its FP16 rate."""
    workload = RequestLengths(1024, 256)
    h100_deployment, h100 = _model(awq, gpu="h100", weights=None)
    a100_deployment, a100 = _model(awq, gpu="a100-80gb", weights=None)
    h = h100.predict(1, workload, h100_deployment.running_cap)
    a = a100.predict(1, workload, a100_deployment.running_cap)
    assert a.ttft_ms > 2 * h.ttft_ms  # a prompt is compute-bound
    assert a.tpot_ms > h.tpot_ms
    busy_h = h100.predict(64, workload, h100_deployment.running_cap)
    busy_a = a100.predict(64, workload, a100_deployment.running_cap)
    assert busy_h.output_throughput_tok_s > 1.8 * busy_a.output_throughput_tok_s


def test_long_prompts_cost_what_their_flops_say(v3) -> None:
    """A 10K-token prompt costs ten 1K prompts in its GEMMs and a hundred in its causal attention."""
    _, model = _model(v3)
    short, long = model.step(0, 1000, 0), model.step(0, 10_000, 0)
    for kind in ("dense_gemm", "moe_gemm"):
        assert long.kind(kind).compute_s / short.kind(kind).compute_s == pytest.approx(10, rel=0.01)
    attention_growth = long.kind("mla_prefill").compute_s / short.kind("mla_prefill").compute_s
    assert attention_growth == pytest.approx(100)


def test_pcie_all_reduce_costs_more_than_nvlink(v3) -> None:
    _, nvlink = _model(v3, gpu="h100", gpus=16, nodes=2)
    _, pcie = _model(v3, gpu="h100-pcie", gpus=16, nodes=2)
    assert pcie.step(64, 0, 2000).comm_s > 3 * nvlink.step(64, 0, 2000).comm_s


def test_tp_across_nodes_pays_the_network(v3) -> None:
    _, inside = _model(v3, gpu="h100", gpus=16, nodes=2)  # TP=8 in a node, PP=2 across
    _, across = _model(v3, gpu="h100", gpus=16, nodes=2, layout=Layout(tp=16))
    assert across.step(64, 0, 2000).comm_s > 5 * inside.step(64, 0, 2000).comm_s


def test_expert_parallelism_uses_all_to_all_instead_of_all_reduce(v3) -> None:
    _, ep = _model(v3, layout=Layout(tp=1, dp=8, ep=True))
    kinds = dict(ep.step(64, 0, 2000).comm)
    assert kinds.get("all_to_all", 0) > 0 and "all_reduce" not in kinds


def test_pipeline_parallel_token_interval_spans_all_stages(v3) -> None:
    deployment, model = _model(v3, gpu="h100", gpus=16, nodes=2)
    p = model.predict(1, RequestLengths(1000, 100), deployment.running_cap)
    # one request: every token crosses both stages (the other stage idles: a pipeline bubble)
    assert p.tpot_ms == pytest.approx(2 * model.step(1, 0, 1050).total_s * 1e3, rel=1e-6)


def test_ttft_grows_with_the_running_batch(v3) -> None:
    """A new prompt waits for the step in flight and for the prompts queued ahead of it."""
    deployment, model = _model(v3)
    workload = RequestLengths(2048, 512)
    ttfts = [model.predict(c, workload, deployment.running_cap).ttft_ms for c in (1, 16, 64, 256)]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 1.5 * ttfts[0]


def test_a_prompt_on_data_parallel_ranks_runs_on_one_rank(v3) -> None:
    """With DP attention a prompt's attention and dense layers run on the rank that holds it, not spread over all
    ranks (issue 20: spread, a 10K prompt came out eight times too fast)."""
    _, dp = _model(v3, layout=Layout(tp=1, dp=8, ep=True))
    one_rank = dp.step(0, 8192, 0, rank=RankLoad(0, 8192))
    spread = dp.step(0, 8192, 0)  # the step's default: balanced over the ranks
    assert one_rank.kind("mla_prefill").compute_s == pytest.approx(64 * spread.kind("mla_prefill").compute_s)
    assert one_rank.kind("dense_gemm").compute_s > 7 * spread.kind("dense_gemm").compute_s
    assert one_rank.kind("moe_gemm").compute_s == pytest.approx(spread.kind("moe_gemm").compute_s)  # all ranks' experts


def test_concurrent_requests_on_data_parallel_ranks_do_not_queue_behind_each_other(v3) -> None:
    """Eight requests on eight DP ranks prefill side by side: TTFT at concurrency 8 stays near one request's, where
    a single TP group prefills them one after another."""
    deployment, dp = _model(v3, layout=Layout(tp=1, dp=8, ep=True))
    workload = RequestLengths(30_000, 200)
    one, eight = (dp.predict(c, workload, deployment.running_cap).ttft_ms for c in (1, 8))
    assert eight < 1.6 * one
    assert expected_max_poisson(0.5, 1) == pytest.approx(0.5)  # one rank: the mean
    assert 1.0 < expected_max_poisson(0.5, 8) < 2.0  # four prompts over eight ranks: the busiest has one or two


def test_tp_across_nodes_pays_each_all_reduce_s_latency_not_the_nic_bandwidth(v3) -> None:
    """TP16 over two nodes: a decode step's all-reduces cost the cross-node latency (NCCL's tree over the
    network), and a long prompt's all-reduces run at the node's NVLink bus bandwidth (hierarchical: each GPU sends
    only its share over its own NIC)."""
    params = EngineParameters(kernels_per_layer=20.0, prefill_efficiency=0.5, cross_node_latency_us=100.0)
    _, across = _model(v3, gpu="h100", gpus=16, nodes=2, layout=Layout(tp=16), parameters=params)
    decode = dict(across.step(1, 0, 1000).comm)["all_reduce"]
    assert decode == pytest.approx(2 * 61 * 100e-6, rel=0.05)
    prefill = dict(across.step(0, 8192, 0).comm)["all_reduce"]
    message = 8192 * v3.hidden_size * 2
    nvlink_bus = 370e9
    assert prefill == pytest.approx(2 * 61 * (100e-6 + 2 * 15 / 16 * message / nvlink_bus), rel=0.05)


def test_tp_inside_a_node_runs_small_all_reduces_on_the_engines_own_kernel(v3) -> None:
    """TP8 inside one NVLink node: a decode step's all-reduces (one token: 14 KB) cost the engines' custom kernel's
    5.8 us (SGLang PR #2904's measurement), not NCCL's 10 us; a long prompt's (8,192 tokens: 117 MB) go to NCCL at
    its 370 GB/s bus bandwidth, where the custom kernel's 274 GB/s would be slower."""
    _, model = _model(v3, gpu="h100")
    per_layer = 2 * 61
    decode = dict(model.step(1, 0, 1000).comm)["all_reduce"]
    one_token = v3.hidden_size * 2
    assert decode == pytest.approx(per_layer * (5.8e-6 + 2 * 7 / 8 * one_token / 274e9), rel=1e-6)
    prefill = dict(model.step(0, 8192, 0).comm)["all_reduce"]
    message = 8192 * v3.hidden_size * 2
    assert prefill == pytest.approx(per_layer * (10e-6 + 2 * 7 / 8 * message / 370e9), rel=1e-6)
    # the crossover: NCCL's larger latency against its larger bandwidth, about 2.5 MB (180 tokens of DeepSeek)
    rates, link = model.rates, model.links.tensor
    custom_at = rates.custom_all_reduce_s(link, 8, 1e6)
    assert custom_at is not None and custom_at < 10e-6 + 1.75 * 1e6 / 370e9
    custom_at = rates.custom_all_reduce_s(link, 8, 4e6)
    assert custom_at is not None and custom_at > 10e-6 + 1.75 * 4e6 / 370e9


def test_speculative_decoding_verifies_k_plus_one_tokens_and_runs_the_draft(v3) -> None:
    spec = speculative_decoding("mtp", 3, acceptance_from_length(3, 2.2), v3)
    assert spec.tokens_per_step == pytest.approx(2.2)
    assert list(spec.acceptance) == sorted(spec.acceptance, reverse=True)
    deployment = build_deployment(v3, "h200", 8, weights="fp8")
    plain = deployment.performance_model(_engine_with(deployment, PARAMETERS))
    with_spec = replace(deployment, speculation=spec).performance_model(_engine_with(deployment, PARAMETERS))
    step, verified = plain.step(1, 0, 1000), with_spec.step(1, 0, 1000)
    assert any(w.kind.startswith("draft_") and w.time_s > 0 for w in verified.work)
    assert verified.total_s > step.total_s
    workload = RequestLengths(1024, 256)
    assert with_spec.predict(1, workload, 64).tpot_ms < plain.predict(1, workload, 64).tpot_ms  # one user gains
    busy = (m.predict(64, workload, 64).output_throughput_tok_s for m in (plain, with_spec))
    gain_alone = plain.predict(1, workload, 64).tpot_ms / with_spec.predict(1, workload, 64).tpot_ms
    assert next(busy) / next(busy) > 1 / gain_alone  # the gain shrinks as batches grow


def test_sglang_prefills_in_steps_of_their_own(v3) -> None:
    """SGLang runs a new prompt as its own forward pass (no mixed steps): the decoders wait for the whole prefill
    step; vLLM's V1 adds the prompt to a decode step."""
    _, sglang = _model(v3, engine="sglang")
    _, vllm = _model(v3)
    assert not sglang.mixed_prefill and vllm.mixed_prefill
    workload = RequestLengths(4096, 256)
    assert sglang.predict(32, workload, 256).tpot_ms > vllm.predict(32, workload, 256).tpot_ms


def _best_and_forced(
    best: Deployment, forced: StepOptions, decode_tokens: int, prefill_tokens: int, context: int
) -> tuple[StepCost, StepCost]:
    """One step of BEST (the class's best kernels) and the same step with the kernels FORCED picks."""
    slower = replace(best, options=forced)
    fast = best.performance_model(_engine_with(best, PARAMETERS)).step(decode_tokens, prefill_tokens, context)
    slow = slower.performance_model(_engine_with(slower, PARAMETERS)).step(decode_tokens, prefill_tokens, context)
    return fast, slow


def test_a_slower_mla_decode_kernel_costs_what_its_bandwidth_fraction_says(v3) -> None:
    """vLLM with --block-size 1 on Blackwell runs Triton's MLA decode (kernels.json's "triton" entry, 27% of the
    bandwidth against TensorRT-LLM's kernel's 72% at 16 heads): the latent-cache read of a large batch takes
    0.72/0.27 times as long, and nothing else in the step changes."""
    b200 = build_deployment(v3, "b200", 8, weights="fp8")
    fast, slow = _best_and_forced(b200, StepOptions(mla_decode_backend="triton"), 450, 0, 2300)
    ratio = slow.kind("mla_decode").memory_s / fast.kind("mla_decode").memory_s
    assert ratio == pytest.approx(0.72 / 0.27)
    assert slow.kind("mla_decode").memory_s > 25e-3  # 450 sequences x 2300 tokens x 70 KB at 27% of 8 TB/s
    assert slow.kind("moe_gemm") == fast.kind("moe_gemm") and slow.comm == fast.comm


def test_an_fp8_cache_on_blackwell_decodes_on_fp8_units(v3) -> None:
    """Blackwell's MLA decode kernels multiply an FP8 cache on FP8 units (kernels.json's "fp8_cache" entry: 50% of
    the FP8 peak against 60% of the BF16 peak for a BF16 cache): at 128 heads (DP attention), where decode attention
    is compute-bound, an FP8 cache's attention takes 0.6 / (2 x 0.5) of the BF16 cache's; Hopper keeps one kernel's
    figures for both."""
    layout = Layout(tp=1, dp=8, ep=True)
    fp8, bf16 = (build_deployment(v3, "b200", 8, weights="fp8", layout=layout, kv_dtype=kv) for kv in ("fp8", "auto"))
    assert fp8.kernel_rates().rate("mla_decode").compute_dtype == "fp8"
    fast, slow = (d.performance_model(_engine_with(d, PARAMETERS)).step(8 * 256, 0, 4096) for d in (fp8, bf16))
    ratio = fast.kind("mla_decode").compute_s / slow.kind("mla_decode").compute_s
    assert ratio == pytest.approx(0.60 / (2 * 0.50))
    hopper = build_deployment(v3, "h200", 8, weights="fp8", kv_dtype="fp8").kernel_rates().rate("mla_decode")
    assert hopper == build_deployment(v3, "h200", 8, weights="fp8").kernel_rates().rate("mla_decode")


def test_sglang_without_deepgemm_runs_its_dense_fp8_gemms_at_tritons_fractions(v3) -> None:
    """SGLang with SGL_ENABLE_JIT_DEEPGEMM=0 runs its Triton FP8 block-scaled GEMM (kernels.json's "fp8_triton" dense
    entry, from SGLang PRs #5207/#5820's side-by-side): a 10K-token prompt's dense GEMMs take DeepGEMM's 0.53 of peak
    over Triton's 0.30 times as long, and the MoE and attention kinds do not change."""
    h200 = build_deployment(v3, "h200", 8, weights="fp8")
    fast, slow = _best_and_forced(h200, StepOptions(dense_gemm_backend="triton"), 0, 10_000, 0)
    ratio = slow.kind("dense_gemm").compute_s / fast.kind("dense_gemm").compute_s
    assert ratio == pytest.approx(0.53 / 0.30)
    assert slow.kind("moe_gemm") == fast.kind("moe_gemm") and slow.kind("mla_prefill") == fast.kind("mla_prefill")


def test_a_dense_gemm_kernel_the_table_lacks_is_refused_with_the_known_ones(v3) -> None:
    deployment = replace(build_deployment(v3, "h200", 8, weights="fp8"), options=StepOptions(dense_gemm_backend="x"))
    with pytest.raises(ConfigError, match="fp8_triton"):
        deployment.kernel_rates()


def test_an_mla_decode_kernel_the_table_lacks_is_refused_with_the_known_ones(v3) -> None:
    deployment = replace(build_deployment(v3, "b200", 8, weights="fp8"), options=StepOptions(mla_decode_backend="x"))
    with pytest.raises(ConfigError, match="known: triton"):
        deployment.kernel_rates()


def test_sglang_0_4_on_rocm_carries_the_step_its_published_run_measured() -> None:
    """dstack's DeepSeek-R1 run on 8 x MI300X with SGLang 0.4.2.post4 (dstackai/benchmarks, online_results.csv:
    3,200 / 800 tokens) measured a mean TPOT of 34.9, 38.8 and 47.1 ms at 4, 8 and 16 clients; the fitted profile
    (SGLang 0.5.19 on ROCm) with the 0.4 series' version fact gives the same within 10%, and 20 ms less per step
    for 0.5."""
    r1 = load_spec("deepseek-ai/DeepSeek-R1")
    workload = RequestLengths(3200, 800)
    tpots = {}
    for version in ("0.4.2", "0.5.19"):
        deployment = build_deployment(r1, "mi300x", 8, engine="sglang", engine_version=version)
        selected = deployment.select_engine()
        assert selected is not None and selected.profile == "sglang-rocm"
        model = deployment.performance_model(selected)
        tpots[version] = [model.predict(c, workload, deployment.running_cap).tpot_ms for c in (4, 8, 16)]
    for predicted, published in zip(tpots["0.4.2"], (34.94, 38.75, 47.09), strict=True):
        assert predicted == pytest.approx(published, rel=0.1)
    for old, new in zip(tpots["0.4.2"], tpots["0.5.19"], strict=True):
        assert old - new == pytest.approx(20.0, rel=0.05)
