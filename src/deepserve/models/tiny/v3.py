"""The tiny DeepSeek-V3: V3's real architecture (MLA + sigmoid-routed, grouped MoE with a shared expert and leading
dense layers) at a size that vLLM's CPU build serves on two cores, optionally with one multi-token-prediction (MTP)
layer as DeepSeek's checkpoints store it.

MLA keeps DeepSeek's real per-head sizes (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128): vLLM's CPU MLA backend accepts no others. Layers, hidden size, heads and experts shrink.
Weights are random but seeded: two runs write byte-identical files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepserve.models.presets import DEEPSEEK_V3_ROPE_SCALING
from deepserve.models.tiny.tokenizer import TINY_VOCAB_SIZE

if TYPE_CHECKING:
    import numpy as np

# DeepSeek-V3's chat format: BOS, system prompt, then <｜User｜> / <｜Assistant｜> turns, each assistant turn closed
# by EOS; tool results wrapped in tool-output markers; the generation prompt is <｜Assistant｜>.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + (message['content'] or '') + '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content']"
    " + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
MAX_POSITIONS = 163840


def tiny_v3_config(mtp_layers: int = 0) -> dict[str, Any]:
    """config.json: every field of DeepSeek-V3's config that vLLM reads, at tiny sizes. MTP_LAYERS is DeepSeek's
    num_nextn_predict_layers: vLLM loads those layers only when speculative decoding asks for them."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "kv_lora_rank": 512,
        "max_position_embeddings": MAX_POSITIONS,
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": mtp_layers,
        "q_lora_rank": 128,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(DEEPSEEK_V3_ROPE_SCALING),  # the real one: vLLM's CPU build accepts it
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": TINY_VOCAB_SIZE,
    }


def v3_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in DeepSeek-V3's Hugging Face layout; MTP layers follow the main ones."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    main = config["num_hidden_layers"]
    for i in range(main + config["num_nextn_predict_layers"]):
        shapes.update(_decoder_layer_shapes(config, i, f"model.layers.{i}."))
        if i >= main:
            shapes.update(_mtp_extra_shapes(config, f"model.layers.{i}."))
    return shapes


def _decoder_layer_shapes(config: dict[str, Any], layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    shapes = {
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
        prefix + "self_attn.q_a_proj.weight": (q_lora, h),
        prefix + "self_attn.q_a_layernorm.weight": (q_lora,),
        prefix + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
        prefix + "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, h),
        prefix + "self_attn.kv_a_layernorm.weight": (kv_lora,),
        prefix + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
        prefix + "self_attn.o_proj.weight": (h, heads * v),
    }
    shapes.update(_mlp_shapes(config, layer, prefix + "mlp."))
    return shapes


def _mtp_extra_shapes(config: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    """What an MTP layer adds to a decoder layer (DeepSeek-V3's README_WEIGHTS.md): its own embedding and head
    copies, norms for the token embedding and the main model's hidden state, and their projection."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    return {
        prefix + "embed_tokens.weight": (vocab, h),
        prefix + "enorm.weight": (h,),
        prefix + "hnorm.weight": (h,),
        prefix + "eh_proj.weight": (h, 2 * h),
        prefix + "shared_head.norm.weight": (h,),
        prefix + "shared_head.head.weight": (vocab, h),
    }


def _mlp_shapes(config: dict[str, Any], layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    h = config["hidden_size"]
    if layer < config["first_k_dense_replace"]:
        return _ffn_shapes(prefix, h, config["intermediate_size"])
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    shapes = {prefix + "gate.weight": (experts, h), prefix + "gate.e_score_correction_bias": (experts,)}
    for e in range(experts):
        shapes.update(_ffn_shapes(f"{prefix}experts.{e}.", h, inter))
    shapes.update(_ffn_shapes(prefix + "shared_experts.", h, inter * config["n_shared_experts"]))
    return shapes


def _ffn_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def v3_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded weights: norms are ones, the router's correction bias is zeros (float32, as in DeepSeek's
    checkpoints), everything else N(0, initializer_range) in bf16, drawn in name order (so MTP layers, whose names
    sort after the main layers', leave the main model's weights as they are without them)."""
    # numpy is imported here only: processes that read the tokenizer and config but write no weights (the
    # simulator, model resolution) start without it
    import numpy as np

    from deepserve.models.safetensors_io import float32_to_bf16_bits

    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    tensors: dict[str, np.ndarray] = {}
    for name, shape in sorted(v3_weight_shapes(config).items()):
        if name.endswith("e_score_correction_bias"):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif "norm" in name:
            tensors[name] = float32_to_bf16_bits(np.ones(shape, dtype=np.float32))
        else:
            tensors[name] = float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * std)
    return tensors
