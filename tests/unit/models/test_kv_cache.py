"""The KV cache per request as vLLM 0.32 allocates it: hand arithmetic from the layouts vLLM documents, and (where
vLLM is installed) the same answers from vLLM's own KV-cache spec classes, grouping and capacity code."""

from __future__ import annotations

import types

import pytest

from deepserve.models.kv_cache import kv_cache_layout
from deepserve.models.presets import preset_spec
from deepserve.models.spec import ModelSpec

GIB = 1024**3


def test_mla_latent_per_token() -> None:
    v3 = preset_spec("v3")
    assert kv_cache_layout(v3, "bfloat16").bytes_per_token == 61 * 576 * 2 == 70_272
    assert kv_cache_layout(v3, "fp8").bytes_per_token == 35_136
    assert kv_cache_layout(v3, "auto").fixed_bytes_per_sequence == 0


def test_v32_latent_plus_indexer_key() -> None:
    v32 = preset_spec("v3.2")
    # fp8_ds_mla (656 B: 512 FP8 + 4 FP32 scales + 64 BF16 RoPE) + indexer key (128 FP8 + one FP32 scale)
    fp8 = kv_cache_layout(v32, "fp8")
    assert fp8.kv_dtype == "fp8_ds_mla"
    assert fp8.bytes_per_token == 61 * (656 + 132) == 48_068  # the notes' "≈ 48,068 B/token"
    assert kv_cache_layout(v32, "auto").bytes_per_token == 61 * (1152 + 132)
    assert kv_cache_layout(v32, "nvfp4_ds_mla").bytes_per_token == 61 * (352 + 132)
    assert fp8.bytes_per_sequence(1_048_576) == 48_068 * 1_048_576  # grows linearly, nothing fixed


def test_v4_flash_growth_and_fixed_state() -> None:
    flash = kv_cache_layout(preset_spec("v4-flash"), "auto")
    assert flash.kv_dtype == "fp8_ds_mla"
    # 21 CSA layers x (584 + 132) / 4 + 20 HCA layers x 584 / 128: the notes' 3,850 B (≈ 3.8 KB) per token
    assert flash.content_bytes_per_token == pytest.approx(21 * (584 + 132) / 4 + 20 * 584 / 128)
    assert 3_800 < flash.content_bytes_per_token < 3_900
    # pages of 256 tokens padded to 576-B multiples: 21 x (37,440 + 8,640) + 20 x 1,728 = 1,002,240 B per block
    assert flash.block_bytes == 1_002_240 and flash.bytes_per_token == pytest.approx(1_002_240 / 256)
    # windows (3 blocks of each of two 64-token groups), CSA compressor state (3 of 4-token blocks) and HCA
    # compressor state (17 of 8-token blocks), each a pool block
    assert flash.fixed_bytes_per_sequence == (3 + 3 + 3 + 17) * 1_002_240


def test_v4_pro_growth() -> None:
    pro = kv_cache_layout(preset_spec("v4-pro"), "fp8")
    assert pro.content_bytes_per_token == pytest.approx(30 * (584 + 132) / 4 + 31 * 584 / 128)
    assert 5_400 < pro.content_bytes_per_token < 5_600  # the notes' "≈ 5.5 KB/token plus a per-request state"
    assert pro.fixed_bytes_per_sequence > 30e6


def test_fp4_indexer_cache_is_smaller() -> None:
    spec = preset_spec("v4-flash")
    fp4 = kv_cache_layout(spec, "fp8", fp4_indexer_cache=True)
    assert fp4.content_bytes_per_token == pytest.approx(21 * (584 + 68) / 4 + 20 * 584 / 128)


def test_bytes_per_token_fall_with_context_for_v4_only() -> None:
    """V4's fixed state is spread over more tokens as the context grows; MLA costs the same per token."""
    flash, v3 = kv_cache_layout(preset_spec("v4-flash")), kv_cache_layout(preset_spec("v3"))
    per_token = [flash.bytes_per_sequence(n) / n for n in (8_192, 131_072, 1_048_576)]
    assert per_token[0] > per_token[1] > per_token[2] > flash.bytes_per_token
    assert v3.bytes_per_sequence(8_192) / 8_192 == v3.bytes_per_sequence(131_072) / 131_072


def test_admission_reserves_a_step_in_flight() -> None:
    flash = kv_cache_layout(preset_spec("v4-flash"))
    decoding = flash.bytes_per_sequence(131_072)
    admitted = flash.admission_bytes_per_sequence(131_072, in_flight_tokens=8_192)
    assert admitted > 4 * decoding  # the CSA compressor state of 8,192 in-flight tokens dominates


def test_draft_layers_add_a_window_on_v4_and_a_latent_on_v3() -> None:
    v4, v3 = preset_spec("v4-flash"), preset_spec("v3")
    with_draft, without = kv_cache_layout(v4, draft_layers=1), kv_cache_layout(v4)
    assert with_draft.bytes_per_token == without.bytes_per_token  # an MTP layer of V4 keeps a window only
    windows = [page for group in with_draft.groups for page in group.pages if page.role == "window"]
    assert len(windows) == 44 and windows[-1].layer == 43
    assert kv_cache_layout(v3, "bfloat16", draft_layers=1).bytes_per_token == 62 * 1152


# ---- against vLLM's own code ------------------------------------------------------------------------------------


def _vllm_specs(spec: ModelSpec, kv_dtype: str, fp4_indexer: bool = False) -> dict:
    """The per-layer KV-cache specs vLLM 0.32 registers for SPEC, written from its get_kv_cache_spec methods
    (vllm/models/deepseek_v4/attention.py, compressor.py, vllm/v1/attention/backends/mla/sparse_swa.py,
    vllm/model_executor/layers/attention/mla_attention.py, vllm/model_executor/models/deepseek_v2.py)."""
    torch = pytest.importorskip("torch")
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    mla, window = interface.MLAAttentionSpec, interface.SlidingWindowMLASpec
    common = {"num_kv_heads": 1, "max_tp_shards": 1}
    specs = {}
    if spec.attention_kind == "mla_sparse":
        packed = {"fp8": 656, "nvfp4_ds_mla": 352}.get(kv_dtype)
        dtype = torch.uint8 if packed else torch.bfloat16
        cache = "fp8_ds_mla" if kv_dtype == "fp8" else kv_dtype
        for layer in range(spec.num_layers):
            specs[f"l{layer}.attn"] = mla(
                block_size=64, head_size=576, dtype=dtype, cache_dtype_str=cache, state_content_bytes=packed, **common
            )
            specs[f"l{layer}.indexer"] = mla(
                block_size=64, head_size=132, dtype=torch.uint8, cache_role=interface.SparseCacheRole.INDEXER, **common
            )
        return specs
    key = 68 if fp4_indexer else 132
    for layer in range(spec.num_layers):
        ratio = max(spec.compress_ratio(layer), 1)
        specs[f"l{layer}.swa"] = window(
            block_size=64, head_size=512, dtype=torch.uint8, sliding_window=spec.sliding_window,
            cache_dtype_str="fp8_ds_mla", state_content_bytes=584, alignment=576, model_version="deepseek_v4",
            **common,
        )  # fmt: skip
        if ratio == 1:
            continue
        overlap = 2 if ratio == 4 else 1
        specs[f"l{layer}.attn"] = mla(
            block_size=256, head_size=512, dtype=torch.uint8, tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla",
            alignment=576, model_version="deepseek_v4", state_content_bytes=584, **common,
        )  # fmt: skip
        specs[f"l{layer}.state"] = window(
            block_size=4 if ratio == 4 else 8, head_size=2 * overlap * 512, dtype=torch.float32,
            sliding_window=overlap * ratio, alignment=576, **common,
        )  # fmt: skip
        if ratio == 4:
            specs[f"l{layer}.indexer"] = mla(
                block_size=256, head_size=key, dtype=torch.uint8, tokens_per_state=4, alignment=576, **common
            )
            specs[f"l{layer}.indexer.state"] = window(
                block_size=4, head_size=2 * 2 * 128, dtype=torch.float32, sliding_window=8, alignment=576, **common
            )
    return specs


def _vllm_capacity(specs: dict, max_model_len: int, available: int, in_flight: int) -> tuple[int, int, list[int]]:
    """vLLM's grouping and start-up capacity: (blocks in the pool, reported tokens, group page sizes)."""
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    layout_module = pytest.importorskip("vllm.v1.kv_cache_layout")
    ns = types.SimpleNamespace
    config = ns(
        scheduler_config=ns(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=in_flight),
        attention_config=ns(hisparse_config=None),
        cache_config=ns(
            get_resolved_kv_cache_layout=lambda: layout_module.KVCacheLayout.BLHNC,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
        ),
        speculative_config=None,
        model_config=ns(max_model_len=max_model_len, hf_config=ns(model_type="deepseek_v4")),
        parallel_config=ns(decode_context_parallel_size=1),
        max_in_flight_tokens=in_flight,
    )
    groups = utils.get_kv_cache_groups(config, dict(specs))
    kv_config = utils.get_kv_cache_config_from_groups(config, groups, available)
    concurrency = utils.get_max_concurrency_for_kv_cache_config(config, kv_config)
    pages = [g.kv_cache_spec.page_size_bytes for g in groups]
    return kv_config.num_blocks, int(concurrency * max_model_len), pages


@pytest.mark.parametrize(
    ("name", "kv_dtype", "fp4_indexer"),
    [
        ("v4-flash", "fp8", False),
        ("v4-flash", "fp8", True),
        ("v4-pro", "fp8", False),
        ("v3.2", "fp8", False),
        ("v3.2", "bfloat16", False),
    ],
)
@pytest.mark.parametrize("max_model_len", [8_192, 131_072, 1_048_576])
def test_capacity_agrees_with_vllm(name: str, kv_dtype: str, fp4_indexer: bool, max_model_len: int) -> None:
    spec = preset_spec(name)
    available, in_flight = 100 * GIB, 8_192
    blocks, tokens, pages = _vllm_capacity(
        _vllm_specs(spec, kv_dtype, fp4_indexer), max_model_len, available, in_flight
    )
    ours = kv_cache_layout(spec, kv_dtype, fp4_indexer_cache=fp4_indexer)
    assert sorted(g.page_bytes for g in ours.groups) == sorted(pages)
    assert available // ours.block_bytes == blocks
    assert ours.engine_reported_tokens(available, max_model_len, in_flight) == tokens
