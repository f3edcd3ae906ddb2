from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from deepserve.models.presets import DEEPSEEK_V3_CONFIG
from deepserve.models.safetensors_io import float32_to_bf16_bits
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import TINY_VOCAB_SIZE, ensure_tiny_model, tiny_config, write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_config_has_every_deepseek_v3_field_vllm_reads() -> None:
    config = tiny_config()
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    # MoE routing exactly as DeepSeek-V3 does it
    assert (config["scoring_func"], config["topk_method"]) == ("sigmoid", "noaux_tc")
    assert config["n_routed_experts"] % config["n_group"] == 0
    assert config["topk_group"] <= config["n_group"]
    assert config["n_shared_experts"] >= 1 and config["routed_scaling_factor"] == 2.5
    assert 0 < config["first_k_dense_replace"] < config["num_hidden_layers"]
    # MLA at DeepSeek's real per-head sizes (vLLM's CPU MLA backend accepts no others)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (128, 128)
    assert config["q_lora_rank"]
    assert config["rope_scaling"] == DEEPSEEK_V3_CONFIG["rope_scaling"]
    assert config["max_position_embeddings"] >= 16384
    missing = (
        set(DEEPSEEK_V3_CONFIG) - set(config) - {"quantization_config", "aux_loss_alpha", "ep_size", "pretraining_tp"}
    )
    assert not missing


def test_weights_are_byte_identical_across_runs(tmp_path: Path, tiny_dir: Path) -> None:
    again = write_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha256(again / name) == _sha256(tiny_dir / name), name


def test_weights_match_the_architecture(tiny_dir: Path) -> None:
    torch = pytest.importorskip("torch", reason="reads the weights back with torch (the engine's install has it)")
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    spec = ModelSpec.from_dir(tiny_dir)
    # the router's correction bias is float32, as in DeepSeek's checkpoints, and counted by router_params

    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (spec.n_routed_experts,)
    assert tensors["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.bfloat16
    assert tuple(tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape) == (512 + 64, spec.hidden_size)
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # the leading dense layer
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in tensors
    assert sum(t.numel() for t in tensors.values()) == spec.total_params
    assert spec.vocab_size == TINY_VOCAB_SIZE


def test_bf16_rounding_is_nearest_even() -> None:
    values = np.array([1.0, -2.5, 1.0 + 2**-8, 1.0 + 3 * 2**-8], dtype=np.float32)
    bits = float32_to_bf16_bits(values)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    assert list(back) == [1.0, -2.5, 1.0, 1.0 + 2**-6]


def test_tokenizer_round_trips_text_and_counts_bytes(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    text = "Hello, wörld! 你好"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 0
    assert len(ids) == 1 + len(text.encode())
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer) == TINY_VOCAB_SIZE


def test_chat_template_is_deepseek_v3_format(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜>"
    )


def test_cached_model_is_made_once(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind
    assert json.loads((first / "config.json").read_text())["model_type"] == "deepseek_v3"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
