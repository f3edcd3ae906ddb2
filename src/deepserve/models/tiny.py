"""The tiny checkpoint: DeepSeek-V3's real architecture (MLA + sigmoid-routed, grouped MoE with a shared expert and
leading dense layers) at a size that vLLM's CPU build serves on two cores.

MLA keeps DeepSeek's real per-head sizes (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128): vLLM's CPU MLA backend accepts no others. Layers, hidden size, heads and experts shrink.
The tokenizer is byte-level BPE without merges (one token per UTF-8 byte) plus DeepSeek-V3's special tokens, so
every text round-trips and a prompt of N tokens is easy to build. Weights are random but seeded: two runs write
byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepserve.models.presets import DEEPSEEK_V3_ROPE_SCALING

if TYPE_CHECKING:
    import numpy as np

TINY_SEED = 20241226  # DeepSeek-V3's release date
FORMAT_VERSION = 1  # bump when the files written change, so cached copies are rebuilt

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
_LEADING_SPECIALS = [BOS, EOS, PAD]
_TRAILING_SPECIALS = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]
TINY_VOCAB_SIZE = 320  # 3 leading specials + 256 bytes + trailing specials + placeholders
BYTE_TOKEN_OFFSET = len(_LEADING_SPECIALS)  # byte b is token BYTE_TOKEN_OFFSET + b

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


def tiny_config() -> dict[str, Any]:
    """config.json: every field of DeepSeek-V3's config that vLLM reads, at tiny sizes."""
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
        "max_position_embeddings": 163840,
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
        "num_nextn_predict_layers": 0,
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


# ---- weights ----------------------------------------------------------------------------------------------------


def tiny_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in DeepSeek-V3's Hugging Face layout."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["vocab_size"], h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_a_proj.weight": (q_lora, h),
                p + "self_attn.q_a_layernorm.weight": (q_lora,),
                p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
                p + "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, h),
                p + "self_attn.kv_a_layernorm.weight": (kv_lora,),
                p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
                p + "self_attn.o_proj.weight": (h, heads * v),
            }
        )
        shapes.update(_mlp_shapes(config, i, p + "mlp."))
    return shapes


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


def tiny_weights(config: dict[str, Any], seed: int = TINY_SEED) -> dict[str, np.ndarray]:
    """Seeded weights: norms are ones, the router's correction bias is zeros (float32, as in DeepSeek's
    checkpoints), everything else N(0, initializer_range) in bf16."""
    # numpy is imported here only: processes that read this module's tokenizer and config but write no weights
    # (the simulator, model resolution) start without it
    import numpy as np

    from deepserve.models.safetensors_io import float32_to_bf16_bits

    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    tensors: dict[str, np.ndarray] = {}
    for name, shape in sorted(tiny_weight_shapes(config).items()):
        if name.endswith("e_score_correction_bias"):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif "norm" in name:
            tensors[name] = float32_to_bf16_bits(np.ones(shape, dtype=np.float32))
        else:
            tensors[name] = float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * std)
    return tensors


# ---- tokenizer ----------------------------------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte-to-printable-character map, in byte order (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def special_tokens() -> list[tuple[int, str]]:
    trailing_start = len(_LEADING_SPECIALS) + 256
    placeholders = [
        f"<｜place▁holder▁no▁{i}｜>" for i in range(TINY_VOCAB_SIZE - trailing_start - len(_TRAILING_SPECIALS))
    ]
    leading = list(enumerate(_LEADING_SPECIALS))
    trailing = [(trailing_start + i, tok) for i, tok in enumerate(_TRAILING_SPECIALS + placeholders)]
    return leading + trailing


def tokenizer_json() -> dict[str, Any]:
    vocab = {tok: i for i, tok in special_tokens()}
    vocab.update({char: BYTE_TOKEN_OFFSET + b for b, char in enumerate(_byte_level_alphabet())})
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in special_tokens()
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    bos_ref = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_ref, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                bos_ref,
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 163840,
        "chat_template": CHAT_TEMPLATE,
    }


# ---- writing -------------------------------------------------------------------------------------------------------


def write_tiny_model(out: Path, seed: int = TINY_SEED) -> Path:
    """Write the checkpoint into OUT (created if needed) and return it."""
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95},
    )
    _write_json(out / "tokenizer.json", tokenizer_json())
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    from deepserve.models.safetensors_io import save_safetensors

    save_safetensors(tiny_weights(config, seed), out / "model.safetensors")
    return out


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def tiny_fingerprint(seed: int = TINY_SEED) -> str:
    """Changes whenever the files written would change: names the cache directory."""
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, seed, tiny_config(), CHAT_TEMPLATE]).encode())
    return digest.hexdigest()[:12]


def ensure_tiny_model(cache_dir: Path) -> Path:
    """The cached tiny checkpoint, made on first use. Written to a temporary directory and renamed, so a crash
    or a concurrent writer never leaves a half-written model in the cache."""
    target = cache_dir / f"tiny-deepseek-v3-{tiny_fingerprint()}"
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    try:
        write_tiny_model(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
