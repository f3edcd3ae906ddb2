"""Every preset's facts against what its publisher says (parameter counts, context, layers, experts), and every
fact in data/presets.json with a source."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from deepserve.models.presets import (
    config_sources,
    exports_of,
    preset_config,
    preset_info,
    preset_names,
    preset_spec,
)

PUBLISHED = [name for name in preset_names() if preset_info(name) is not None]

# How close our count (from the config's tensor shapes, as vLLM builds the layers) must come to the figure the
# model card rounds: 1% for totals given to three digits, 7% for "13B" (V4-Flash's 13.8B with embeddings) and
# "37B" (V3.2's indexer adds 0.9B to V3's 37.6B), 2% for "1.6T" (1,573B).
TOLERANCE = {"total_params": 0.02, "active_params": 0.07}


def _data() -> dict:
    return json.loads(resources.files("deepserve.models").joinpath("data/presets.json").read_text())


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_the_model_card(name: str) -> None:
    spec, info = preset_spec(name), preset_info(name)
    assert info is not None
    for fact, count in (("total_params", spec.total_params), ("active_params", spec.active_params)):
        published = info.fact(fact)
        if published is not None:
            assert count == pytest.approx(published.value, rel=TOLERANCE[fact]), (fact, published.source)


@pytest.mark.parametrize("name", PUBLISHED)
def test_context_length_is_the_published_one(name: str) -> None:
    info = preset_info(name)
    assert info is not None
    published = info.fact("context_length")
    if published is not None:
        assert preset_spec(name).max_position_embeddings == published.value


@pytest.mark.parametrize(
    ("name", "layers", "experts", "top_k", "kind"),
    [
        ("deepseek-ai/DeepSeek-V3.1", 61, 256, 8, "mla"),
        ("deepseek-ai/DeepSeek-V3.1-Terminus", 61, 256, 8, "mla"),
        ("deepseek-ai/DeepSeek-V3.2-Exp", 61, 256, 8, "mla_sparse"),
        ("deepseek-ai/DeepSeek-V3.2", 61, 256, 8, "mla_sparse"),
        ("deepseek-ai/DeepSeek-V3.2-Speciale", 61, 256, 8, "mla_sparse"),
        ("deepseek-ai/DeepSeek-V4-Flash", 43, 256, 6, "compressed_sparse"),
        ("deepseek-ai/DeepSeek-V4-Flash-0731", 43, 256, 6, "compressed_sparse"),
        ("deepseek-ai/DeepSeek-V4-Pro", 61, 384, 6, "compressed_sparse"),
        ("deepseek-ai/DeepSeek-V4-Pro-0813", 61, 384, 6, "compressed_sparse"),
    ],
)
def test_layer_and_expert_counts(name: str, layers: int, experts: int, top_k: int, kind: str) -> None:
    spec = preset_spec(name)
    assert (spec.num_layers, spec.n_routed_experts, spec.num_experts_per_tok) == (layers, experts, top_k)
    assert spec.attention_kind == kind


def test_v32_lightning_indexer() -> None:
    spec = preset_spec("v3.2")
    assert (spec.index_n_heads, spec.index_head_dim, spec.index_topk) == (64, 128, 2048)
    assert spec.architecture == "DeepseekV32ForCausalLM"
    # the indexer's query projection (q latent 1536 -> 64 heads x 128) on each of 61 layers
    assert spec.parameter_breakdown()["indexer"] == 61 * 1536 * 64 * 128


def test_v4_flash_structure() -> None:
    spec = preset_spec("v4-flash")
    assert spec.layers_with_ratio(0) == 2 and spec.layers_with_ratio(4) == 21 and spec.layers_with_ratio(128) == 20
    assert (spec.sliding_window, spec.o_groups, spec.hc_mult, spec.num_hash_layers) == (128, 8, 4, 3)
    assert (spec.index_topk, spec.head_dim, spec.expert_dtype) == (512, 512, "fp4")
    assert spec.num_dense_layers == 0 and spec.num_moe_layers == 43
    # routed experts: 43 layers x 256 x 3 x 4096 x 2048 = 277.0B (third-party table of routed-expert bytes: 277.0B)
    assert spec.parameter_breakdown()["routed_experts"] == 43 * 256 * 3 * 4096 * 2048


def test_v4_pro_structure() -> None:
    spec = preset_spec("v4-pro")
    assert spec.layers_with_ratio(0) == 0 and spec.layers_with_ratio(4) == 30 and spec.layers_with_ratio(128) == 31
    assert (spec.o_groups, spec.q_lora_rank, spec.index_topk, spec.moe_intermediate_size) == (16, 1536, 1024, 3072)
    assert spec.parameter_breakdown()["routed_experts"] == pytest.approx(1547.4e9, rel=0.001)


def test_draft_modules() -> None:
    v4 = preset_spec("v4-flash")
    assert (v4.draft_method, v4.num_mtp_layers) == ("mtp", 1)
    dspark = preset_spec("v4-pro-0813")
    assert (dspark.draft_method, dspark.num_mtp_layers, dspark.dspark_block_size) == ("dspark", 3, 5)
    # Pro-0813's checkpoint is ~893 GB against the preview's ~865 GB with the MTP head dropped: its three draft
    # layers (MXFP4 experts) come to about the 28 GB difference plus one MTP layer (~14 GB)
    assert dspark.draft_params_loaded() == 3 * preset_spec("v4-pro").draft_params_loaded()
    assert preset_spec("cognitivecomputations/DeepSeek-V3-AWQ").draft_method is None


def test_repacks_keep_the_architecture_and_change_the_experts() -> None:
    base = preset_spec("v4-pro")
    nvfp4 = preset_spec("nvidia/DeepSeek-V4-Pro-NVFP4")
    fp8 = preset_spec("sgl-project/DeepSeek-V4-Pro-FP8")
    assert nvfp4.total_params == fp8.total_params == base.total_params
    assert nvfp4.quantization is not None and nvfp4.quantization.moe_quant_algo == "NVFP4"
    assert fp8.expert_dtype == "fp8"


def test_exports_name_the_checkpoint_they_requantize() -> None:
    assert exports_of("v3") == ["cognitivecomputations/DeepSeek-V3-AWQ"]
    assert exports_of("R1") == ["cognitivecomputations/DeepSeek-R1-AWQ"]  # aliases and case resolve
    v4_pro = ["nvidia/DeepSeek-V4-Pro-NVFP4", "sgl-project/DeepSeek-V4-Pro-FP8"]
    assert exports_of("deepseek-ai/DeepSeek-V4-Pro") == v4_pro
    assert exports_of("deepseek-ai/DeepSeek-V3.2") == exports_of("/models/a-local-dir") == []
    for name in PUBLISHED:
        info = preset_info(name)
        assert info is not None
        origin = info.quantized_from
        if origin is None:
            continue
        export, base = preset_spec(name), preset_spec(origin.model)
        assert origin.source.startswith("https://"), name
        assert (export.num_layers, export.hidden_size, export.n_routed_experts) == (
            base.num_layers,
            base.hidden_size,
            base.n_routed_experts,
        ), f"{name} is not an export of {origin.model}: another architecture"


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_config_key_and_fact_names_its_source(name: str) -> None:
    sources = config_sources(name)
    assert set(sources) == set(preset_config(name)), "a config key without a source (or a source for none)"
    assert all(text.strip() for text in sources.values())
    info = preset_info(name)
    assert info is not None and all(fact.source.strip() for fact in info.published)


def test_sources_are_urls_or_repository_paths_or_say_reconstructed() -> None:
    for key, text in _data()["sources"].items():
        assert text.startswith(("https://", "vLLM 0.32", "reconstructed")) or "index id" in text, key


def test_reconstructed_facts_say_so() -> None:
    """V4-Flash's instruct config.json was never reachable: its keys must cite the reconstruction."""
    sources = config_sources("deepseek-ai/DeepSeek-V4-Flash")
    assert sources["hidden_size"].startswith("reconstructed")
    assert "verbatim" in config_sources("deepseek-ai/DeepSeek-V4-Flash-Base")["compress_ratios"]


def test_v41_checkpoints_are_refused_until_modelled() -> None:
    """V4.1's KV sharing and Engram tables would be planned wrongly as V4's: a clear error instead (also for the
    nested multimodal config.json it ships)."""
    from deepserve.errors import ModelError
    from deepserve.models.spec import ModelSpec

    text = {**preset_config("v4-flash"), "model_type": "deepseek_v41_text", "kv_source_layer_ids": [2, 8, 14, 20]}
    nested = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text}
    with pytest.raises(ModelError, match="V4.1 shares compressed KV"):
        ModelSpec.from_hf_config(nested, name="local/DeepSeek-V4.1-Flash")
