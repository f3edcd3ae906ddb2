from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.errors import ModelError
from deepserve.models import load_spec
from deepserve.models.presets import DEEPSEEK_V3_CONFIG, preset_names, preset_spec
from deepserve.models.spec import ModelSpec


def test_deepseek_v3_parameter_totals_match_published_figures() -> None:
    spec = preset_spec("deepseek-ai/DeepSeek-V3")
    assert spec.total_params == pytest.approx(671e9, rel=0.005)
    assert spec.active_params == pytest.approx(37e9, rel=0.03)
    assert spec.mtp_params() == pytest.approx(14e9, rel=0.05)
    assert (spec.num_dense_layers, spec.num_moe_layers) == (3, 58)


def test_deepseek_v3_latent_kv_cache_bytes() -> None:
    spec = preset_spec("deepseek-ai/DeepSeek-V3")
    assert spec.kv_values_per_token_per_layer == 576
    assert spec.kv_bytes_per_token("bfloat16") == 70_272
    assert spec.kv_bytes_per_token("fp8") == 35_136


def test_per_layer_attention_count_by_hand() -> None:
    spec = preset_spec("deepseek-ai/DeepSeek-V3")
    h, n = 7168, 128
    q = h * 1536 + 1536 + 1536 * n * 192
    kv = h * 576 + 512 + 512 * n * 256
    o = n * 128 * h
    assert spec.attention_params_per_layer == q + kv + o


def test_v2_lite_has_no_q_lora_and_its_published_size() -> None:
    spec = preset_spec("deepseek-ai/DeepSeek-V2-Lite")
    assert spec.q_lora_rank is None
    assert spec.total_params == pytest.approx(15.7e9, rel=0.01)


def test_awq_preset_reads_quantization() -> None:
    spec = preset_spec("cognitivecomputations/DeepSeek-V3-0324-AWQ")
    assert spec.quantization is not None
    assert (spec.quantization.method, spec.quantization.bits, spec.quantization.group_size) == ("awq", 4, 64)
    fp8 = preset_spec("deepseek-ai/DeepSeek-R1").quantization
    assert fp8 is not None and fp8.block_size == (128, 128)


def test_required_presets_exist_and_aliases_resolve() -> None:
    for name in (
        "deepseek-ai/DeepSeek-V3",
        "deepseek-ai/DeepSeek-V3-0324",
        "deepseek-ai/DeepSeek-R1",
        "cognitivecomputations/DeepSeek-V3-0324-AWQ",
        "deepseek-ai/DeepSeek-V2-Lite",
        "deepserve/tiny-deepseek-v3",
    ):
        assert name in preset_names()
    assert preset_spec("TINY").name == "deepserve/tiny-deepseek-v3"
    assert preset_spec("deepseek-ai/deepseek-v3").name == "deepseek-ai/DeepSeek-V3"


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ModelError, match="presets: .*deepseek-ai/DeepSeek-V3"):
        load_spec("deepseek-ai/DeepSeek-V9")


def test_local_directory_spec(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    assert load_spec(str(tmp_path)).total_params == preset_spec("deepseek-ai/DeepSeek-V3").total_params


def test_directory_without_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json"):
        load_spec(str(tmp_path))


def test_config_missing_required_fields_names_them() -> None:
    with pytest.raises(ModelError, match="num_hidden_layers, hidden_size"):
        ModelSpec.from_hf_config({"vocab_size": 10, "num_attention_heads": 2}, name="broken")


def test_invalid_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        ModelSpec.from_dir(tmp_path)
