"""The tiny DeepSeek-V4: V4's architecture (compressed sparse attention with a sliding window, per-layer compression
ratios and the lightning indexer; manifold-constrained hyper-connections; hash-routed and score-routed MoE with a
shared expert) at a size that vLLM 0.32's CPU build serves, in DeepSeek's own checkpoint layout (`layers.N.attn.wq_a`,
`layers.N.ffn.experts.E.w1`, `embed`, `head`), which vLLM's V4 loader maps itself.

What must stay DeepSeek's (measured on vLLM 0.32's CPU build, see docs/TINY_MODELS.md): head_dim 512,
qk_rope_head_dim 64, index_head_dim 128, index_topk 512; its CPU top-k kernels exist for 64/128/256/384 experts with
top-6 or top-8 only. Everything else shrinks. Weights are random but seeded.

There is no MTP layer: vLLM's CPU build does not implement V4's MTP (models/deepseek_v4/cpu/mtp.py raises).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepserve.models.tiny.tokenizer import TINY_VOCAB_SIZE

if TYPE_CHECKING:
    import numpy as np

MAX_POSITIONS = 1048576
# (layer, compression ratio): 0 a sliding window only; 4 compressed sparse attention (with the indexer); 128 heavily
# compressed attention. The last entry is the MTP layer's slot, as in DeepSeek's configs.
COMPRESS_RATIOS = [0, 4, 128, 4, 0]


def tiny_v4_config() -> dict[str, Any]:
    """config.json with the keys vLLM's DeepseekV4 model reads (transformers_utils/configs/deepseek_v4.py and
    models/deepseek_v4/), DeepSeek-V4-Flash's values where size does not matter."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "compress_ratios": list(COMPRESS_RATIOS),
        "compress_rope_theta": 160000,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 512,
        "hidden_act": "silu",
        "hidden_size": 256,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "initializer_range": 0.02,
        "max_position_embeddings": MAX_POSITIONS,
        "moe_intermediate_size": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts_per_tok": 6,
        "num_hash_layers": 2,
        "num_hidden_layers": len(COMPRESS_RATIOS) - 1,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 0,
        "o_groups": 2,
        "o_lora_rank": 128,
        "q_lora_rank": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 128,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": TINY_VOCAB_SIZE,
    }


# Tensors vLLM keeps in float32 (hyper-connection mixers, attention sinks, compressor position biases, the router's
# correction bias) and the hash-routing table (int32); everything else is bf16.
_FLOAT32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")
_INT32_SUFFIXES = ("tid2eid",)


def v4_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, vocab, hc = config["hidden_size"], config["vocab_size"], config["hc_mult"]
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (vocab, h),
        "head.weight": (vocab, h),
        "norm.weight": (h,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"layers.{layer}."
        shapes.update(_hyper_connection_shapes(config, prefix))
        shapes.update(_attention_shapes(config, prefix + "attn.", config["compress_ratios"][layer]))
        shapes.update(_moe_shapes(config, prefix + "ffn.", hashed=layer < config["num_hash_layers"]))
    return shapes


def _hyper_connection_shapes(config: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    h, hc = config["hidden_size"], config["hc_mult"]
    mix = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {prefix + "attn_norm.weight": (h,), prefix + "ffn_norm.weight": (h,)}
    for part in ("attn", "ffn"):
        shapes.update(
            {
                f"{prefix}hc_{part}_fn": (mix, hc * h),
                f"{prefix}hc_{part}_base": (mix,),
                f"{prefix}hc_{part}_scale": (3,),
            }
        )
    return shapes


def _attention_shapes(config: dict[str, Any], prefix: str, compress_ratio: int) -> dict[str, tuple[int, ...]]:
    h, heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    q_lora, o_lora, groups = config["q_lora_rank"], config["o_lora_rank"], config["o_groups"]
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "attn_sink": (heads,),
        prefix + "wq_a.weight": (q_lora, h),
        prefix + "q_norm.weight": (q_lora,),
        prefix + "wq_b.weight": (heads * head_dim, q_lora),
        prefix + "wkv.weight": (head_dim, h),
        prefix + "kv_norm.weight": (head_dim,),
        prefix + "wo_a.weight": (groups * o_lora, heads * head_dim // groups),
        prefix + "wo_b.weight": (h, groups * o_lora),
    }
    if compress_ratio > 1:
        shapes.update(_compressor_shapes(h, head_dim, compress_ratio, prefix + "compressor."))
    if compress_ratio == 4:  # only compressed sparse attention selects its tokens with the lightning indexer
        index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
        shapes.update(
            {
                prefix + "indexer.wq_b.weight": (index_heads * index_dim, q_lora),
                prefix + "indexer.weights_proj.weight": (index_heads, h),
            }
        )
        shapes.update(_compressor_shapes(h, index_dim, compress_ratio, prefix + "indexer.compressor."))
    return shapes


def _compressor_shapes(hidden: int, head_dim: int, ratio: int, prefix: str) -> dict[str, tuple[int, ...]]:
    width = (2 if ratio == 4 else 1) * head_dim  # ratio 4 compresses overlapping windows: twice the width
    return {
        prefix + "ape": (ratio, width),
        prefix + "wkv.weight": (width, hidden),
        prefix + "wgate.weight": (width, hidden),
        prefix + "norm.weight": (head_dim,),
    }


def _moe_shapes(config: dict[str, Any], prefix: str, hashed: bool) -> dict[str, tuple[int, ...]]:
    h, experts, inter = config["hidden_size"], config["n_routed_experts"], config["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (experts, h)}
    if hashed:  # the first layers route by a token-id table instead of scores
        shapes[prefix + "gate.tid2eid"] = (config["vocab_size"], config["num_experts_per_tok"])
    else:
        shapes[prefix + "gate.bias"] = (experts,)
    for expert in range(experts):
        shapes.update(_expert_shapes(f"{prefix}experts.{expert}.", h, inter))
    shapes.update(_expert_shapes(prefix + "shared_experts.", h, inter * config["n_shared_experts"]))
    return shapes


def _expert_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "w1.weight": (inter, hidden),
        prefix + "w2.weight": (hidden, inter),
        prefix + "w3.weight": (inter, hidden),
    }


def v4_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded weights: norms and hyper-connection scales ones, biases and sinks zeros, the hash table a seeded
    choice of distinct experts per token, everything else N(0, initializer_range)."""
    import numpy as np

    from deepserve.models.safetensors_io import float32_to_bf16_bits

    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    tensors: dict[str, np.ndarray] = {}
    for name, shape in sorted(v4_weight_shapes(config).items()):
        if name.endswith(_INT32_SUFFIXES):
            tensors[name] = _hash_table(rng, shape, config["n_routed_experts"])
        elif name.endswith(("gate.bias", "attn_sink", "_base")):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif name.endswith(("_scale", "norm.weight")):
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = rng.standard_normal(shape, dtype=np.float32) * std
    for name, value in tensors.items():
        if value.dtype == np.float32 and not name.endswith(_FLOAT32_SUFFIXES):
            tensors[name] = float32_to_bf16_bits(value)
    return tensors


def _hash_table(rng: np.random.Generator, shape: tuple[int, ...], experts: int) -> np.ndarray:
    import numpy as np

    vocab, top_k = shape
    return np.stack([rng.choice(experts, size=top_k, replace=False) for _ in range(vocab)]).astype(np.int32)
