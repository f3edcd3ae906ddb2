"""Built-in model presets: the config.json of published DeepSeek-V3-class checkpoints, usable with no network.

DeepSeek-V3, V3-0324 and R1 share one architecture; they differ in weights only.
"""

from __future__ import annotations

import copy
from typing import Any

from deepserve.errors import ModelError, unknown_name
from deepserve.models.spec import ModelSpec

_FP8_BLOCKWISE = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# YaRN: trained at 4K positions, stretched 40x to 160K.
DEEPSEEK_V3_ROPE_SCALING: dict[str, Any] = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}

DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": _FP8_BLOCKWISE,
    "rms_norm_eps": 1e-06,
    "rope_scaling": DEEPSEEK_V3_ROPE_SCALING,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# cognitivecomputations' AWQ export: 4-bit weights in groups of 64, fp16 activations, no MTP module.
_AWQ_CONFIG = {
    **DEEPSEEK_V3_CONFIG,
    "torch_dtype": "float16",
    "num_nextn_predict_layers": 0,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    },
}

DEEPSEEK_V2_LITE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}

TINY_MODEL_NAME = "deepserve/tiny-deepseek-v3"


def _preset_configs() -> dict[str, dict[str, Any]]:
    from deepserve.models.tiny import TINY_MODELS

    return {
        "deepseek-ai/DeepSeek-V3": DEEPSEEK_V3_CONFIG,
        "deepseek-ai/DeepSeek-V3-0324": DEEPSEEK_V3_CONFIG,
        "deepseek-ai/DeepSeek-R1": DEEPSEEK_V3_CONFIG,
        "deepseek-ai/DeepSeek-R1-0528": DEEPSEEK_V3_CONFIG,
        "cognitivecomputations/DeepSeek-V3-AWQ": _AWQ_CONFIG,
        "cognitivecomputations/DeepSeek-V3-0324-AWQ": _AWQ_CONFIG,
        "cognitivecomputations/DeepSeek-R1-AWQ": _AWQ_CONFIG,
        "deepseek-ai/DeepSeek-V2-Lite": DEEPSEEK_V2_LITE_CONFIG,
        **{name: model.config() for name, model in TINY_MODELS.items()},
    }


_ALIASES = {"v3": "deepseek-ai/DeepSeek-V3", "r1": "deepseek-ai/DeepSeek-R1"}


def _aliases() -> dict[str, str]:
    from deepserve.models.tiny import TINY_ALIASES

    return {**_ALIASES, **TINY_ALIASES}


def preset_names() -> list[str]:
    return list(_preset_configs())


def canonical_preset_name(name: str) -> str | None:
    """The preset's canonical name for NAME (case-insensitive, short aliases allowed), or None."""
    name = _aliases().get(name.lower(), name)
    by_lower = {key.lower(): key for key in _preset_configs()}
    return by_lower.get(name.lower())


def preset_config(name: str) -> dict[str, Any]:
    canonical = canonical_preset_name(name)
    if canonical is None:
        raise ModelError(unknown_name("model preset", name, preset_names()))
    return copy.deepcopy(_preset_configs()[canonical])


def preset_spec(name: str) -> ModelSpec:
    canonical = canonical_preset_name(name)
    if canonical is None:
        raise ModelError(unknown_name("model preset", name, preset_names()))
    return ModelSpec.from_hf_config(preset_config(canonical), name=canonical)
