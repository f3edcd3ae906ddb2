"""DeepSeek-V3.2 and V4 in the planner: the vendors' published layouts fit, what cannot fit is refused with the
nearest layout that can, draft modules cost their weights, and the step model's attention follows the compressed
context. Layouts from the vLLM recipes (vllm-project/recipes @ 8959cf6, models/deepseek-ai/*.yaml), the vLLM V4
blog (4 x B200 / 8 x B200 data-parallel + EP), NVIDIA Dynamo (V4-Pro NVFP4 on 8 x B200) and SGLang's V4 cookbook
(docs_new/src/snippets/configs/deepseek-ai/deepseek-v4.jsx: V4-Flash TP4 on H200, V4-Pro FP8 on 16 x H200 over
two nodes, V4-Pro FP4 TP8 on 8 x H200)."""

from __future__ import annotations

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.hardware.catalog import get_accelerator
from deepserve.models.presets import preset_spec
from deepserve.plan.admission import check_gpu_fit, draft_modules_loaded
from deepserve.plan.layout import Layout
from deepserve.plan.perf import PerformanceModel
from deepserve.plan.planner import build_deployment, make_plan, smallest_fitting_gpus
from deepserve.plan.types import PlanConfig

FLASH, PRO = "deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro"
PRO_FP8, PRO_NVFP4 = "sgl-project/DeepSeek-V4-Pro-FP8", "nvidia/DeepSeek-V4-Pro-NVFP4"
DP = {"dp4": Layout(tp=1, dp=4, ep=True), "dp8": Layout(tp=1, dp=8, ep=True), "dp16": Layout(tp=1, dp=16, ep=True)}


@pytest.mark.parametrize(
    ("model", "gpu", "gpus", "nodes", "layout", "settings"),
    [
        (FLASH, "b200", 4, 1, "dp4", {}),  # vLLM blog quick-start: --data-parallel-size 4 --enable-expert-parallel
        (FLASH, "b200", 4, 1, None, {}),  # SGLang low-latency: --tp 4
        (FLASH, "h200", 4, 1, None, {}),  # SGLang H200 FP4: --tp 4 --moe-runner-backend marlin
        ("sgl-project/DeepSeek-V4-Flash-FP8", "h200", 4, 1, None, {}),  # SGLang H200 FP8: --tp 4
        (PRO, "b200", 8, 1, "dp8", {}),  # vLLM blog: --data-parallel-size 8 on 8 x B200
        (PRO_NVFP4, "b200", 8, 1, None, {}),  # Dynamo: NVFP4, TP8 + EP on 8 x B200
        (PRO_FP8, "h200", 16, 2, "dp16", {"gpu_memory_utilization": 0.88}),  # SGLang: --tp 16 --dp 16, two nodes
        (PRO, "h200", 8, 1, None, {}),  # SGLang H200 FP4: --tp 8
        (PRO, "h200", 8, 1, "dp8", {"max_model_len": 200_000, "gpu_memory_utilization": 0.95}),  # vLLM recipe
        ("deepseek-ai/DeepSeek-V3.2", "h200", 8, 1, None, {}),  # vLLM recipe: --tensor-parallel-size 8
        ("deepseek-ai/DeepSeek-V3.2", "h200", 8, 1, "dp8", {"kv_dtype": "fp8"}),  # recipe: -dp 8 --enable-ep
    ],
)
def test_published_layouts_fit(model: str, gpu: str, gpus: int, nodes: int, layout: str | None, settings: dict) -> None:
    deployment = build_deployment(
        preset_spec(model), gpu, gpus, nodes=nodes, layout=DP[layout] if layout else None, **settings
    )
    assert deployment.memory.fits, deployment.memory


@pytest.mark.parametrize(
    ("model", "gpu", "gpus", "nearest"),
    [
        (PRO, "b200", 4, 8),  # 865 GB of weights: a GB200 NVL4 tray is too small too (vLLM recipe: two trays)
        (PRO_FP8, "h200", 8, 16),  # FP8 experts need the second node
        (FLASH, "h100", 2, 4),  # 160 GB on two 80 GB GPUs: no; four: yes
        ("deepseek-ai/DeepSeek-V3.2", "h200", 4, 8),
        (PRO, "rtx-pro-6000", 8, 16),  # SGLang: "V4-Pro doesn't fit on 8x 96 GB"
    ],
)
def test_what_cannot_fit_is_refused_with_the_nearest_layout(model: str, gpu: str, gpus: int, nearest: int) -> None:
    assert not build_deployment(preset_spec(model), gpu, gpus).memory.fits
    assert smallest_fitting_gpus(PlanConfig(model=model, gpu=gpu, gpus=gpus)) == nearest
    plan = make_plan(PlanConfig(model=model, gpu=gpu, gpus=gpus, concurrency=[1]))
    assert not plan.fits and plan.smallest_fitting_gpus == nearest
    layout = next(e.text for e in plan.explanations if e.topic == "layout")
    assert f"{nearest} x {gpu}" in layout


def test_serve_preflight_names_the_nearest_fit() -> None:
    config = EngineConfig(model=PRO, tensor_parallel_size=4, gpu_type="b200")
    check = check_gpu_fit(config, PRO, get_accelerator("b200"))
    assert check.fits is False
    assert "it fits on 8 x b200 (1 node(s)): --tensor-parallel-size 8" in check.suggestion


def test_mtp_weights_and_kv_count_when_speculative_decoding_is_on() -> None:
    spec = preset_spec(FLASH)
    off = build_deployment(spec, "b200", 4).memory
    on = build_deployment(spec, "b200", 4, draft_modules=True).memory
    assert on.draft_modules == "mtp" and off.draft_modules is None
    # one MTP layer (a MoE layer of 256 MXFP4 experts with window attention) split over TP=4: about 0.9 GB per GPU
    assert on.draft_bytes_per_gpu == pytest.approx(spec.draft_layer_params() * 0.55 / 4, rel=0.1)
    assert on.weights_bytes_per_gpu == off.weights_bytes_per_gpu + on.draft_bytes_per_gpu
    assert on.kv_cache_bytes_per_gpu < off.kv_cache_bytes_per_gpu


def test_dspark_loads_three_draft_layers() -> None:
    memory = build_deployment(preset_spec("deepseek-ai/DeepSeek-V4-Pro-0813"), "b200", 8, draft_modules=True).memory
    mtp = build_deployment(preset_spec(PRO), "b200", 8, draft_modules=True).memory
    assert memory.draft_modules == "dspark"
    assert memory.draft_bytes_per_gpu == pytest.approx(3 * mtp.draft_bytes_per_gpu, rel=0.01)


@pytest.mark.parametrize(
    ("args", "loaded"),
    [
        (["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'], True),
        (['--speculative-config={"method": "dspark", "num_speculative_tokens": 7}'], True),
        (["--speculative-config", '{"method":"ngram","num_speculative_tokens":3}'], False),
        ([], False),
    ],
)
def test_preflight_sees_the_draft_modules_in_the_engine_flags(args: list[str], loaded: bool) -> None:
    assert draft_modules_loaded(EngineConfig(model=FLASH, extra_args=args)) is loaded


def test_v4_kv_capacity_is_growth_plus_a_fixed_state_per_request() -> None:
    memory = build_deployment(preset_spec(FLASH), "b200", 4, max_model_len=131_072).memory
    cache = memory.kv_layout
    assert cache is not None and not cache.is_linear
    assert memory.kv_fixed_bytes_per_sequence == cache.fixed_bytes_per_sequence > 20e6
    per_request = memory.kv_bytes_per_sequence(memory.sequence_len)
    # the prompts of the steps in flight hold their windows' pages until their steps settle: the decoding
    # requests share what is left
    held = memory.kv_prompt_in_flight_bytes
    assert held == cache.prompt_in_flight_bytes(1024, memory.in_flight_tokens) > 0
    assert memory.max_concurrent_sequences == (memory.kv_cache_bytes_per_gpu - held) // per_request
    # the engine's start-up figure reserves each window for a step in flight (2 x 8,192 tokens with async
    # scheduling): far fewer tokens than the decoding requests' bytes would suggest
    assert memory.kv_cache_tokens < memory.kv_cache_bytes_per_gpu / cache.bytes_per_token


def test_prompts_in_flight_hold_window_pages_by_the_token() -> None:
    """vLLM 0.32 frees a windowed cache's pages only once a step has settled: an 8K prompt writes 2,048 pages of
    the 4-token compressor state (and 1,024 of the 8-token one) before any is freed, each a block of the pool's
    size; two steps are in flight with async scheduling (vllm/v1/kv_cache_interface.py, SlidingWindowSpec)."""
    cache = build_deployment(preset_spec(PRO), "h200", 8, max_model_len=9216).memory.kv_layout
    assert cache is not None
    one = cache.prompt_in_flight_bytes(8192, 8192)
    assert cache.prompt_in_flight_bytes(8192, 16384) == 2 * one
    windowed = [g for g in cache.groups if g.window is not None]
    pages = sum(g.blocks(8192, 8192) - g.blocks(8192) for g in windowed)
    assert one == pages * cache.block_bytes and pages > 2048 + 1024
    assert build_deployment(preset_spec("deepseek-ai/DeepSeek-V3"), "h200", 8).memory.kv_prompt_in_flight_bytes == 0


def test_sparse_attention_reserves_its_prefill_workspace() -> None:
    """V3.2's FlashMLA-sparse gathers factor x max_model_len rows of 576 16-bit values (factor 5 up to 256K tokens);
    V4 gathers four prompts' compressed contexts; MLA reserves none."""
    v32 = build_deployment(preset_spec("deepseek-ai/DeepSeek-V3.2"), "h200", 8, max_model_len=163_840).memory
    assert v32.workspace_bytes_per_gpu == 5 * 163_840 * 576 * 2
    v4 = build_deployment(preset_spec(FLASH), "b200", 4, max_model_len=1_048_576).memory
    short = build_deployment(preset_spec(FLASH), "b200", 4, max_model_len=9216).memory
    assert v4.workspace_bytes_per_gpu > 10 * short.workspace_bytes_per_gpu > 0
    assert build_deployment(preset_spec("deepseek-ai/DeepSeek-V3"), "h200", 8).memory.workspace_bytes_per_gpu == 0


def test_fp4_indexer_cache_leaves_more_room() -> None:
    spec = preset_spec(PRO)
    fp8 = build_deployment(spec, "b200", 8, layout=DP["dp8"]).memory
    fp4 = build_deployment(spec, "b200", 8, layout=DP["dp8"], fp4_indexer_cache=True).memory
    assert fp4.kv_bytes_per_token < fp8.kv_bytes_per_token
    assert fp4.max_concurrent_sequences > fp8.max_concurrent_sequences


def test_v4_attention_cost_follows_the_compressed_context() -> None:
    """V3's decode attention grows with the whole context; V4's with a window, top-k entries and 1/128 of it."""
    v4 = build_deployment(preset_spec(FLASH), "b200", 4).performance_model()
    v3 = build_deployment(preset_spec("v3"), "b200", 8).performance_model()

    def read_s(model: PerformanceModel, context: int) -> float:
        return model.step(64, 0, context).kind("mla_decode").memory_s

    assert read_s(v3, 131_072) / read_s(v3, 8_192) == pytest.approx(16, rel=0.01)
    # index keys grow as ctx/4 (and dominate at 128K), HCA entries as ctx/128; window and top-k are capped
    assert 2 < read_s(v4, 131_072) / read_s(v4, 8_192) < 10
    assert read_s(v3, 131_072) > 30 * read_s(v4, 131_072)


def test_v4_plan_explains_the_fp4_experts_on_hopper() -> None:
    plan = make_plan(PlanConfig(model=FLASH, gpu="h200", gpus=4, concurrency=[1]))
    text = next(e.text for e in plan.explanations if e.topic == "quantization")
    assert "MXFP4 experts on h200: weight-only" in text
    kv = next(e.text for e in plan.explanations if e.topic == "kv_cache")
    assert "sliding windows and compressor state" in kv
