from __future__ import annotations

import pytest

from deepserve.models import load_spec
from deepserve.models.spec import COMPONENTS


@pytest.mark.parametrize("name", ["deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V2-Lite", "tiny"])
def test_breakdown_sums_to_total_params(name: str) -> None:
    spec = load_spec(name)
    breakdown = spec.parameter_breakdown()
    assert tuple(breakdown) == COMPONENTS
    assert sum(breakdown.values()) == spec.total_params


def test_deepseek_v3_components_match_hand_arithmetic() -> None:
    spec = load_spec("v3")
    parts = spec.parameter_breakdown()
    # 58 MoE layers x 256 experts x 3 x 7168 x 2048
    assert parts["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    # q_a (7168x1536) + kv_a (7168x576) per layer, replicated under tensor parallelism
    assert parts["attention_latent"] == 61 * 7168 * (1536 + 576)
    assert parts["dense_mlp"] == 3 * 3 * 7168 * 18432
    assert parts["embedding"] == parts["lm_head"] == 129280 * 7168
    assert parts["router"] == 58 * (7168 * 256 + 256)


def test_layer_breakdown_sums_to_layer_params() -> None:
    spec = load_spec("v3")
    for index in (0, 2, 3, 60):
        assert sum(spec.layer_parameter_breakdown(index).values()) == spec.layer_params(index)
    assert spec.layer_parameter_breakdown(0)["routed_experts"] == 0
    assert spec.layer_parameter_breakdown(3)["dense_mlp"] == 0
