from __future__ import annotations

import pytest

from deepserve.models import load_spec
from deepserve.plan.factors import EfficiencyFactors, SelectedFactors
from deepserve.plan.layout import Layout
from deepserve.plan.perf import Workload, expected_distinct_experts
from deepserve.plan.planner import build_deployment

FACTORS = SelectedFactors(EfficiencyFactors(100.0, 0.8, 0.3), "test", "test")


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


def _model(v3, gpu="h200", gpus=8, **kwargs):
    deployment = build_deployment(v3, gpu, gpus, weights="fp8", **kwargs)
    return deployment, deployment.performance_model(FACTORS)


def test_expected_distinct_experts_hand_values() -> None:
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 2) == pytest.approx(256 * (1 - (248 / 256) ** 2))  # 15.75
    assert expected_distinct_experts(256, 8, 64) == pytest.approx(256 * (1 - (1 - 1 / 32) ** 64))
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert expected_distinct_experts(0, 0, 5) == 0


def test_single_token_decode_is_memory_bound_and_large_prefill_compute_bound(v3) -> None:
    _, model = _model(v3)
    decode = model.step(1, 0, 2048)
    assert decode.memory_s > decode.compute_s
    prefill = model.step(0, 8192, 0)
    assert prefill.compute_s > prefill.memory_s


def test_decode_step_bytes_by_hand(v3) -> None:
    """At batch 1 a GPU reads its shard of attention, dense and shared weights, 8 experts per MoE layer, the output
    head, and one token's latent cache over every layer."""
    _deployment, model = _model(v3)
    step = model.step(1, 0, 1000)
    parts = v3.parameter_breakdown()
    fp8 = 1 + 4 / 128**2
    static = (
        parts["attention_latent"] * fp8
        + (parts["attention_heads"] + parts["dense_mlp"] + parts["shared_experts"]) * fp8 / 8
        + (parts["norms"] + parts["router"]) * 2
        - v3.hidden_size * 2  # the final norm lives outside the layers
        + parts["lm_head"] * 2 / 8
    )
    experts = 58 * 8 * v3.expert_params * fp8 / 8
    kv = 1000 * 70_272
    expected_s = (static + experts + kv) / (4800e9 * 0.8)
    assert step.memory_s == pytest.approx(expected_s, rel=1e-3)


def test_tpot_grows_with_concurrency_and_throughput_saturates(v3) -> None:
    deployment, model = _model(v3)
    workload = Workload(2048, 512)
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
    p = model.predict(16, Workload(1000, 200), deployment.running_cap)
    e2e_s = (p.ttft_ms + 199 * p.tpot_ms) / 1e3
    assert p.output_throughput_tok_s == pytest.approx(16 * 200 / e2e_s, rel=1e-6)


def test_ttft_at_concurrency_one_is_a_solo_prefill(v3) -> None:
    deployment, model = _model(v3)
    p = model.predict(1, Workload(4096, 100), deployment.running_cap)
    assert p.ttft_ms == pytest.approx(model.step(0, 4096, 2048).total_s * 1e3)


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
    assert ep.step(64, 0, 2000).comm_s > 0
    assert ep._comm_s(64) != pytest.approx(0)


def test_pipeline_parallel_token_interval_spans_all_stages(v3) -> None:
    deployment, model = _model(v3, gpu="h100", gpus=16, nodes=2)
    p = model.predict(1, Workload(1000, 100), deployment.running_cap)
    # one request: every token crosses both stages (the other stage idles: a pipeline bubble)
    assert p.tpot_ms == pytest.approx(2 * model.step(1, 0, 1050).total_s * 1e3, rel=1e-6)


def test_ttft_grows_with_the_running_batch(v3) -> None:
    """A new prompt waits for the step in flight and for the prompts queued ahead of it."""
    deployment, model = _model(v3)
    workload = Workload(2048, 512)
    ttfts = [model.predict(c, workload, deployment.running_cap).ttft_ms for c in (1, 16, 64, 256)]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 1.5 * ttfts[0]
