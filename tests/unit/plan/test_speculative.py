"""Speculative decoding in the plan: acceptance per position, the verification and draft costs of a step, the
tokens per step in predictions, the memory of the MTP module, and the direction on this CPU."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from deepserve.errors import ConfigError
from deepserve.hardware import host
from deepserve.hardware.catalog import host_accelerator
from deepserve.models import load_spec
from deepserve.plan.memory import DRAFT_COMPONENT
from deepserve.plan.perf import RequestLengths, expected_distinct_experts
from deepserve.plan.planner import build_deployment, make_plan
from deepserve.plan.profiles import EngineParameters
from deepserve.plan.speculative import (
    MTP_PUBLISHED_ACCEPTANCE,
    SpeculativeDecoding,
    SpeculativeModel,
    acceptance_per_position,
    parse_acceptance,
    speculative_decoding,
)
from deepserve.plan.types import PlanConfig

PARAMETERS = EngineParameters(kernels_per_layer=20.0, prefill_efficiency=0.5)
CPU_PARAMETERS = EngineParameters(
    kernels_per_layer=0.0, prefill_efficiency=1.0, step_overhead_ms=3.0, per_sequence_us=1000.0
)


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


def _models(spec, speculation, gpu="h200", parameters=PARAMETERS, **kwargs):
    """The same deployment without and with SPECULATION, under PARAMETERS."""
    plain = build_deployment(spec, gpu, kwargs.pop("gpus", 8), weights="fp8", **kwargs)
    selected = plain.select_engine()
    assert selected is not None  # across_engines=True always finds the device's profile
    engine = selected.with_parameters(parameters)
    with_spec = replace(plain, speculation=speculation)
    return plain.performance_model(engine), with_spec.performance_model(engine)


# ---- acceptance ----------------------------------------------------------------------------------------------------


def test_acceptance_per_position_and_tokens_per_step() -> None:
    assert acceptance_per_position([0.8], 3) == pytest.approx((0.8, 0.64, 0.512))  # each given the ones before
    assert acceptance_per_position([0.8, 0.6, 0.4], 3) == (0.8, 0.6, 0.4)  # vLLM's per-position rates
    assert acceptance_per_position([0.8, 0.6, 0.4], 2) == (0.8, 0.6)  # a chain's first positions do not change
    speculation = SpeculativeDecoding("mtp", 3, (0.8, 0.6, 0.4), 1)
    assert speculation.tokens_per_step == pytest.approx(1 + 0.8 + 0.6 + 0.4)  # 2.8
    assert speculation.conditional_acceptance() == pytest.approx((0.8, 0.75, 0.4 / 0.6))
    assert parse_acceptance("0.8, 0.6,0.4") == (0.8, 0.6, 0.4)
    with pytest.raises(ConfigError, match="must not increase"):
        acceptance_per_position([0.5, 0.7], 2)
    with pytest.raises(ConfigError, match="one rate per position"):
        acceptance_per_position([0.9, 0.8], 3)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        parse_acceptance("1.2")


def test_published_defaults_and_methods_without_one(v3) -> None:
    mtp = speculative_decoding("mtp", 3, (), v3)
    assert mtp.acceptance == MTP_PUBLISHED_ACCEPTANCE[:3]
    assert mtp.tokens_per_step == pytest.approx(2.82)  # TensorRT-LLM's measured R1 acceptance length with 3 drafts
    assert speculative_decoding("mtp", 7, (), v3).acceptance[5:] == (0.0, 0.0)
    dspark = speculative_decoding("dspark", 7, (), v3).acceptance
    assert dspark[0] == pytest.approx(0.7) and dspark[6] == pytest.approx(0.1)
    assert speculative_decoding("ngram", 2, (0.5,), v3).draft_layers == 0
    with pytest.raises(ConfigError, match="--spec-acceptance"):
        speculative_decoding("ngram", 3, (), v3)
    with pytest.raises(ConfigError, match="not modelled"):
        speculative_decoding("draft_model", 3, (0.5,), v3)


# ---- one step ------------------------------------------------------------------------------------------------------


def test_verification_reads_once_and_computes_k_plus_one_tokens(v3) -> None:
    """Verifying K+1 tokens of one sequence reads the same weights and cache as one decode token, computes K+1
    times its FLOPs, and touches the experts of K+1 tokens."""
    plain, _ = _models(v3, None)
    one = plain.step(1, 0, 1000)
    four = plain.step(1, 0, 1000, queries_per_sequence=4)
    assert four.kind("dense_gemm").memory_s == pytest.approx(one.kind("dense_gemm").memory_s)
    assert four.kind("dense_gemm").compute_s == pytest.approx(4 * one.kind("dense_gemm").compute_s)
    assert four.kind("mla_decode").memory_s == pytest.approx(one.kind("mla_decode").memory_s)
    assert four.kind("mla_decode").compute_s == pytest.approx(4 * one.kind("mla_decode").compute_s)
    experts = expected_distinct_experts(256, 8, 4) / expected_distinct_experts(256, 8, 1)
    assert four.kind("moe_gemm").memory_s == pytest.approx(experts * one.kind("moe_gemm").memory_s)
    assert four.overhead_s == pytest.approx(one.overhead_s)  # per sequence, not per token


def test_a_speculative_step_is_verification_plus_k_draft_passes(v3) -> None:
    speculation = SpeculativeDecoding("mtp", 3, (0.9, 0.7, 0.5), 1)
    plain, spec_model = _models(v3, speculation)
    assert isinstance(spec_model, SpeculativeModel)
    step = spec_model.step(1, 0, 1000)
    verify = plain.step(1, 0, 1000, queries_per_sequence=4)
    drafter = spec_model.drafter
    assert drafter is not None and drafter.spec.num_layers == 1 and drafter.spec.num_moe_layers == 1
    first = drafter.step(1, 0, 1000, queries_per_sequence=4).total_s
    later = drafter.step(1, 0, 1001).total_s
    parts = step.breakdown_s()
    draft_s = sum(seconds for kind, seconds in parts.items() if kind.startswith("draft_"))
    assert step.total_s == pytest.approx(verify.total_s + draft_s)
    eh_proj = parts["draft_eh_proj"]
    assert draft_s == pytest.approx(first + 2 * later + eh_proj)
    # each pass is an engine step of the one-layer draft module: 20 small kernels at the launch time, 3 passes
    assert parts["draft_engine_overhead"] == pytest.approx(3 * 20 * spec_model.rates.launch_us["cuda_graph"] * 1e-6)
    assert sum(parts.values()) == pytest.approx(step.total_s)  # the breakdown still sums to the step


def test_tpot_is_the_step_over_the_tokens_it_yields(v3) -> None:
    speculation = SpeculativeDecoding("mtp", 2, (0.8, 0.5), 1)
    _, spec_model = _models(v3, speculation)
    workload = RequestLengths(1024, 256)
    prediction = spec_model.predict(1, workload, running_cap=64)
    step_s = spec_model.step(1, 0, 1024 + 128).total_s
    assert prediction.tpot_ms == pytest.approx(step_s / 2.3 * 1e3)  # 1 + 0.8 + 0.5 tokens a step


def test_the_gain_falls_as_the_batch_grows(v3) -> None:
    """At one user verification costs little (the step reads the weights once, plus the experts of K+1 tokens);
    once the batch is large the step is compute-bound and verifying K+1 tokens costs nearly K+1 times as much.
    (Between, a MoE's verification touches several times the experts of a decode step: the gain dips at ~8.)"""
    speculation = speculative_decoding("mtp", 3, (), v3)
    plain, spec_model = _models(v3, speculation)
    workload = RequestLengths(1024, 1024)

    def gain(concurrency: int) -> float:
        faster = spec_model.predict(concurrency, workload, 1024).output_throughput_tok_s
        return faster / plain.predict(concurrency, workload, 1024).output_throughput_tok_s

    assert gain(1) > 2.0  # 2.82 tokens a step for a little more than one step's time
    assert gain(64) > gain(256) > gain(1024)
    assert gain(1024) < gain(1) - 0.5


def test_speculation_is_slower_on_this_cpu_even_at_full_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """shared/DESIGN.md (2026-11-26): on the tiny model vLLM's CPU build was slower with MTP than without, even with
    every draft accepted. On the CPU profile a draft pass costs an engine step of its own (the CPU build's
    overhead per forward), and on a host without bf16 units (15 GFLOP/s: the machine the profile was fitted on)
    the tiny model's verification is compute-bound: K+1 tokens cost K+1 times."""
    measured = host.HostMeasurement("box", "Test CPU", 2, 26.0, 140.0, 15.2, "2026-11-23T00:00:00Z")
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    tiny = replace(load_spec("deepserve/tiny-deepseek-v3"), num_mtp_layers=1)
    workload = RequestLengths(128, 128)
    accelerator = host_accelerator(measured)

    def throughput(speculation: SpeculativeDecoding | None, concurrency: int) -> float:
        deployment = build_deployment(
            tiny, "host", 1, accelerator=accelerator, workload=workload, max_model_len=4096, speculation=speculation
        )
        model = deployment.performance_model()
        assert model.engine.profile == "vllm-cpu"
        return model.predict(concurrency, workload, deployment.running_cap).output_throughput_tok_s

    for concurrency in (1, 4, 16):
        without = throughput(None, concurrency)
        for k in (1, 2, 3):
            assert throughput(speculative_decoding("mtp", k, (1.0,), tiny), concurrency) < without


# ---- memory and the plan -------------------------------------------------------------------------------------------


def test_memory_counts_the_mtp_layer_and_its_cache(v3) -> None:
    plain = build_deployment(v3, "h200", 8, weights="fp8")
    without = plain.memory
    speculation = speculative_decoding("mtp", 1, (), v3)
    with_mtp = build_deployment(v3, "h200", 8, weights="fp8", speculation=speculation).memory
    (module,) = (part for part in with_mtp.components if part.component == DRAFT_COMPONENT)
    assert with_mtp.weights_bytes_per_gpu == without.weights_bytes_per_gpu + module.bytes_per_gpu
    # one MoE decoder layer split 8 ways (256 experts of 3 x 7168 x 2048 FP8 weights dominate) + eh_proj in BF16
    experts = 256 * 3 * 7168 * 2048 / 8 * plain.fmt.bytes_per_param("routed_experts")
    assert experts < module.bytes_per_gpu < experts * 1.25
    assert module.bytes_per_gpu > 2 * 7168 * 7168 * 2  # eh_proj alone, replicated
    assert with_mtp.kv_bytes_per_token_per_gpu == 62 * 576 * 2  # the MTP layer's latent: 62 layers, not 61
    assert with_mtp.kv_cache_tokens < without.kv_cache_tokens
    ngram = build_deployment(v3, "h200", 8, weights="fp8", speculation=speculative_decoding("ngram", 3, (0.5,), v3))
    assert ngram.memory.weights_bytes_per_gpu == without.weights_bytes_per_gpu  # n-gram loads nothing


def test_plan_json_and_commands_carry_it() -> None:
    config = PlanConfig(
        model="deepseek-ai/DeepSeek-R1",
        gpu="h200",
        speculative_method="mtp",
        num_speculative_tokens=3,
        spec_acceptance=[0.9, 0.7, 0.5],
        concurrency=[1],
    )
    plan = make_plan(config)
    data = plan.to_json()
    assert data["speculative_decoding"]["tokens_per_step"] == pytest.approx(3.1)
    assert data["mtp_params_not_loaded"] == 0
    assert "draft_modules" in data["weights_by_component"]
    vllm = plan.commands["vllm"]
    words = shlex.split(vllm)
    config_json = json.loads(words[words.index("--speculative-config") + 1])
    assert config_json == {"method": "mtp", "num_speculative_tokens": 3}
    assert "--speculative-num-draft-tokens 4" in plan.commands["sglang"]
    assert "--speculative-method mtp --num-speculative-tokens 3" in plan.serve_commands[0]
    off = make_plan(
        config.model_copy(update={"speculative_method": None, "num_speculative_tokens": None, "spec_acceptance": []})
    )
    assert off.to_json()["mtp_params_not_loaded"] > 0 and off.to_json()["speculative_decoding"] is None
    assert plan.predictions[0].tpot_ms < off.predictions[0].tpot_ms


def test_plan_config_reads_acceptance_as_flags_give_it() -> None:
    assert PlanConfig(spec_acceptance="0.8,0.6").spec_acceptance == [0.8, 0.6]
    assert PlanConfig(spec_acceptance=["0.8", "0.6,0.4"]).spec_acceptance == [0.8, 0.6, 0.4]
    with pytest.raises(ConfigError, match="--spec-acceptance needs"):
        make_plan(PlanConfig(spec_acceptance=[0.5]))
