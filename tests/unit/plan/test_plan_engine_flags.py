"""The engine flags a plan prints (and `deploy render` renders, through the same function): --max-num-seqs with the
engines' own meaning (per data-parallel rank in vLLM's V1 engine, all pipeline micro-batches together), no
--trust-remote-code for models the engines implement, and wide expert parallelism across nodes with PP 1."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepserve.engines.registry import get_engine
from deepserve.models.resolve import ResolvedModel
from deepserve.plan.commands import engine_config, needs_remote_code
from deepserve.plan.explain import explain_kv_cache
from deepserve.plan.planner import make_plan
from deepserve.plan.types import PlanConfig

V3 = "deepseek-ai/DeepSeek-V3"
GPU_MODEL = ResolvedModel(V3, V3, on_cpu=False)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_wide_expert_parallelism_across_two_nodes_plans_pp_1() -> None:
    plan = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, tp=1, dp=16, ep=True))
    layout = plan.deployment.layout
    assert (layout.tp, layout.pp, layout.dp, layout.ep, plan.deployment.nodes) == (1, 1, 16, True, 2)
    assert plan.fits
    config = engine_config(plan.deployment, plan.config, "vllm")
    assert (config.data_parallel_size, config.pipeline_parallel_size, config.nnodes) == (16, 1, 2)
    argv = get_engine("vllm").launch_spec(config, GPU_MODEL, None).argv
    assert flag(argv, "--data-parallel-size-local") == "8"  # eight ranks on each node


def test_tp_spanning_two_nodes_plans_pp_1_and_the_default_stays_tp_in_a_node_pp_across() -> None:
    wide = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, tp=16)).deployment.layout
    assert (wide.tp, wide.pp) == (16, 1)
    default = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16)).deployment.layout
    assert (default.tp, default.pp) == (8, 2)
    given = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, tp=8)).deployment.layout
    assert (given.tp, given.pp) == (8, 2)


def test_max_num_seqs_is_per_data_parallel_rank() -> None:
    plan = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, tp=1, dp=16, ep=True))
    d = plan.deployment
    config = engine_config(d, plan.config, "vllm")
    assert d.running_cap == d.memory.max_concurrent_sequences  # the KV cache of all 16 ranks
    assert config.max_num_seqs == d.running_cap // 16  # each rank's scheduler applies it to its own requests
    capped = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, tp=1, dp=16, ep=True, max_num_seqs=64)).deployment
    assert capped.running_cap == min(64 * 16, capped.memory.max_concurrent_sequences)
    sglang = get_engine("sglang").launch_spec(config, GPU_MODEL, None).argv
    assert flag(sglang, "--max-running-requests") == str(config.max_num_seqs * 16)  # SGLang's cap is global


def test_max_num_seqs_caps_all_pipeline_micro_batches_together_in_vllm_v1() -> None:
    plan = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16))
    d = plan.deployment
    assert d.layout.pp == 2
    assert engine_config(d, plan.config, "vllm").max_num_seqs == d.running_cap  # not running_cap / PP
    capped = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, max_num_seqs=128)).deployment
    assert capped.running_cap == 128
    old = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, max_num_seqs=128, engine_version="0.7.3")).deployment
    assert old.running_cap == 256  # vLLM's V0 engine had a scheduler per pipeline stage


V4_FLASH = "deepseek-ai/DeepSeek-V4-Flash"


def v4_on_sglang(**given: object) -> PlanConfig:
    return PlanConfig(
        model=V4_FLASH,
        gpu="b200",
        gpus=4,
        tp=1,
        dp=4,
        ep=True,
        engine="sglang",
        input_len=8192,
        output_len=1024,
        **given,
    )


def test_sglang_runs_deepseek_v4_with_its_own_default_of_256_requests_shared_over_the_dp_ranks() -> None:
    d = make_plan(v4_on_sglang()).deployment
    assert d.memory.max_concurrent_sequences > 1000  # the KV cache alone would admit thousands
    assert (d.engine_default_running_requests, d.max_num_seqs_in_effect, d.running_cap) == (256, 64, 256)
    assert d.max_num_seqs_per_rank == 64
    on_vllm = make_plan(v4_on_sglang().model_copy(update={"engine": "vllm"})).deployment
    assert on_vllm.engine_default_running_requests is None  # vLLM has no such default: the KV cache decides
    assert on_vllm.running_cap == on_vllm.memory.max_concurrent_sequences


def test_a_given_max_num_seqs_overrides_the_engines_default_and_other_engines_commands_do_not_inherit_it() -> None:
    given = make_plan(v4_on_sglang(max_num_seqs=200)).deployment
    assert given.max_num_seqs_in_effect == 200  # on each of the 4 ranks, in place of SGLang's 64
    pool = given.engine_pool_sequences_per_rank  # at 8K prompts each rank's sliding-window pool holds fewer
    assert pool is not None and 64 < pool < 200 and given.running_cap == 4 * pool
    plan = make_plan(v4_on_sglang())
    assert engine_config(plan.deployment, plan.config, "sglang").max_num_seqs == 64
    on_vllm = engine_config(plan.deployment, plan.config, "vllm").max_num_seqs
    assert on_vllm is not None and on_vllm > 64  # vLLM's command gets the KV cache's cap, not SGLang's default
    words = explain_kv_cache(plan.config, plan.deployment)
    assert "sglang's own default for DeepseekV4ForCausalLM (256 running requests" in words


def test_sglang_dp_attention_splits_the_prefill_chunk_over_its_ranks_and_vllm_does_not() -> None:
    on_sglang = make_plan(v4_on_sglang(max_num_batched_tokens=16384)).deployment
    assert on_sglang.prefill_tokens_per_rank_step == 4096  # SGLang: --chunked-prefill-size // dp_size
    on_vllm = make_plan(v4_on_sglang(max_num_batched_tokens=16384).model_copy(update={"engine": "vllm"}))
    assert on_vllm.deployment.prefill_tokens_per_rank_step == 16384
    words = " ".join(e.text for e in make_plan(v4_on_sglang(max_num_batched_tokens=16384)).explanations)
    assert "each prefills at most 4,096 prompt tokens a step, so a 8,192-token prompt takes 2 prefill steps" in words
    assert "prefill chunk over" not in " ".join(e.text for e in on_vllm.explanations)


def test_deepseek_needs_no_remote_code() -> None:
    plan = make_plan(PlanConfig(model=V3, gpu="h200", gpus=8))
    assert engine_config(plan.deployment, plan.config, "vllm").trust_remote_code is False
    assert all("--trust-remote-code" not in line for line in plan.commands.values())
    assert not needs_remote_code(plan.deployment.spec)
    assert needs_remote_code(replace(plan.deployment.spec, model_type="my_own_arch"))


@pytest.mark.parametrize("network", ["ib", "infiniband-ndr", "roce", "tcp", "ethernet-100g"])
def test_the_plan_takes_the_network_profiles_by_either_name(network: str) -> None:
    plan = make_plan(PlanConfig(model=V3, gpu="h100", gpus=16, network=network))
    assert plan.deployment.network.name in ("ib", "roce", "tcp")
