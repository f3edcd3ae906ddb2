"""The tiny V4 and the tiny V3 with MTP: configs, weights, tokenizer, and the Markov chain the MTP variants encode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deepserve.errors import ModelError
from deepserve.models.presets import canonical_preset_name, preset_spec
from deepserve.models.resolve import resolve_model
from deepserve.models.tiny import (
    BYTE_TOKEN_OFFSET,
    TINY_MODELS,
    ensure_tiny_model,
    is_tiny_model,
    tiny_fingerprint,
    tiny_model,
    tiny_model_for,
    write_tiny_model,
)
from deepserve.models.tiny.markov import (
    SUCCESSOR_LOGITS,
    byte_token,
    greedy_next,
    partial_draft_misses,
    simulate_greedy_speculation,
    successor_probabilities,
)
from deepserve.models.tiny.tokenizer import V4_SPECIALS
from deepserve.models.tiny.v4 import COMPRESS_RATIOS

V4 = "deepserve/tiny-deepseek-v4"
MTP_FULL, MTP_PARTIAL = "deepserve/tiny-deepseek-v3-mtp", "deepserve/tiny-deepseek-v3-mtp-partial"


def _floats(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32) if bits.dtype == np.uint16 else bits


def _logits(tensors: dict[str, np.ndarray], head: str) -> np.ndarray:
    """What the edited model computes from each token: head @ RMSNorm(embedding)."""
    embedding = _floats(tensors["model.embed_tokens.weight"])
    normed = embedding / np.sqrt((embedding**2).mean(axis=1, keepdims=True) + 1e-6)
    return np.asarray(normed @ _floats(tensors[head]).T)


def test_the_default_tiny_model_is_unchanged() -> None:
    """Its cache key (so everyone's cached copy stays valid) and its files: the MTP variants are new presets."""
    assert tiny_fingerprint() == "774c6b8d1369"
    assert "num_nextn_predict_layers" in tiny_model().config()
    assert tiny_model().config()["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("tiny", "deepserve/tiny-deepseek-v3"),
        ("tiny-v4", V4),
        ("TINY-MTP", MTP_FULL),
        ("tiny-mtp-partial", MTP_PARTIAL),
    ],
)
def test_every_tiny_model_is_a_preset_with_an_alias(alias: str, name: str) -> None:
    assert canonical_preset_name(alias) == name and is_tiny_model(alias)
    assert preset_spec(alias).num_layers == 4


def test_cli_choices_name_the_presets() -> None:
    assert tiny_model_for("deepseek-v4").name == V4
    assert tiny_model_for("deepseek-v3", "partial").name == MTP_PARTIAL
    with pytest.raises(ModelError, match="does not run DeepSeek-V4's MTP"):
        tiny_model_for("deepseek-v4", "full")
    with pytest.raises(ModelError, match="deepseek-v3"):
        tiny_model_for("deepseek-v5")


def test_each_tiny_model_has_its_own_cache_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_HOME", str(tmp_path))
    resolved = resolve_model("tiny-v4", on_cpu=True)
    assert resolved.served_name == V4
    assert Path(resolved.source).name == f"tiny-deepseek-v4-{tiny_fingerprint(V4)}"
    assert len({tiny_fingerprint(name) for name in TINY_MODELS}) == len(TINY_MODELS)


# ---- the tiny V4 ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-v4"), V4)


def test_v4_config_keeps_the_sizes_vllms_cpu_kernels_need() -> None:
    config = tiny_model(V4).config()
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["model_type"] == "deepseek_v4"
    assert (config["head_dim"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["index_head_dim"], config["index_topk"]) == (128, 512)
    assert config["n_routed_experts"] in (64, 128, 256, 384) and config["num_experts_per_tok"] in (6, 8)
    assert len(config["compress_ratios"]) == config["num_hidden_layers"] + 1  # + the MTP slot, as DeepSeek's
    assert {0, 4, 128} <= set(config["compress_ratios"])  # window-only, compressed sparse, heavily compressed


def test_v4_weights_follow_deepseeks_layout(v4_dir: Path) -> None:
    pytest.importorskip("torch", reason="reads the weights back with torch (the engine's install has it)")
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(v4_dir / "model.safetensors"))
    config = tiny_model(V4).config()
    for layer, ratio in enumerate(COMPRESS_RATIOS[:-1]):
        prefix = f"layers.{layer}.attn."
        assert (prefix + "compressor.wkv.weight" in tensors) == (ratio > 1)
        assert (prefix + "indexer.wq_b.weight" in tensors) == (ratio == 4)
    hashed = tensors["layers.0.ffn.gate.tid2eid"]
    assert hashed.dtype == torch.int32 and tuple(hashed.shape) == (config["vocab_size"], config["num_experts_per_tok"])
    assert all(len(set(row.tolist())) == config["num_experts_per_tok"] for row in hashed)  # distinct experts
    assert "layers.0.ffn.gate.bias" not in tensors and "layers.2.ffn.gate.bias" in tensors
    assert tensors["layers.1.hc_attn_fn"].dtype == torch.float32
    assert tensors["layers.1.attn.wq_b.weight"].dtype == torch.bfloat16
    assert tuple(tensors["layers.1.attn.wo_a.weight"].shape) == (2 * 128, 8 * 512 // 2)


def test_v4_tokenizer_speaks_v4s_chat_format(v4_dir: Path) -> None:
    """vLLM's V4 encoder (tokenizer mode deepseek_v4) writes V4's specials, and each is one token of ours; like
    DeepSeek's release, the tiny V4 has no Jinja template."""
    from transformers import AutoTokenizer

    encoding = _vllm_v4_encoding()
    tokenizer = AutoTokenizer.from_pretrained(str(v4_dir))
    assert tokenizer.chat_template is None
    text = encoding.encode_messages([{"role": "user", "content": "Say hi."}], thinking_mode="chat")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 11  # BOS, <｜User｜>, 7 bytes, <｜Assistant｜>, </think>: DESIGN.md's measured 11
    for special in V4_SPECIALS:
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1, special


def _vllm_v4_encoding():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizers" / "deepseek_v4_encoding.py"
    loaded = importlib.util.spec_from_file_location("deepseek_v4_encoding", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)  # plain Python, no vLLM imports: the encoder vLLM runs
    return module


# ---- the tiny V3 with MTP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def partial_weights() -> dict[str, np.ndarray]:
    return tiny_model(MTP_PARTIAL).weights()


def test_mtp_layer_is_stored_as_deepseek_stores_it(partial_weights: dict[str, np.ndarray]) -> None:
    config = tiny_model(MTP_PARTIAL).config()
    assert config["num_nextn_predict_layers"] == 1
    mtp = f"model.layers.{config['num_hidden_layers']}."
    hidden = config["hidden_size"]
    assert partial_weights[mtp + "eh_proj.weight"].shape == (hidden, 2 * hidden)
    for name in ("enorm", "hnorm", "shared_head.norm", "mlp.gate", "self_attn.kv_a_proj_with_mqa"):
        assert mtp + name + ".weight" in partial_weights, name
    assert mtp + "mlp.experts.0.down_proj.weight" in partial_weights  # a full MoE decoder layer


def test_main_model_is_the_designed_markov_chain(partial_weights: dict[str, np.ndarray]) -> None:
    logits = _logits(partial_weights, "lm_head.weight")
    for byte in (0, ord("a"), 200, 255):
        row = logits[BYTE_TOKEN_OFFSET + byte]
        successors = [byte_token(byte + step) for step in (1, 2, 3)]
        assert np.allclose(row[successors], SUCCESSOR_LOGITS, atol=0.02)
        others = np.delete(row, successors)
        assert np.abs(others).max() < 0.05  # every other token, EOS included: logit 0
    # attention and feed-forward add nothing to the residual stream: the last hidden state is the embedding
    zeroed = [name for name in partial_weights if name.endswith(("o_proj.weight", "down_proj.weight"))]
    assert zeroed and all(not partial_weights[name].any() for name in zeroed)
    # special tokens (a chat prompt ends in <｜Assistant｜>) behave as byte `a`
    assert int(np.argmax(logits[0])) == greedy_next(0) == byte_token(ord("b"))


def _draft_tokens(tensors: dict[str, np.ndarray]) -> np.ndarray:
    """The MTP layer's greedy draft after each token, as vLLM computes it: the main model's head (vLLM shares it with
    the MTP layer) over RMSNorm(eh_proj([RMSNorm(embedding), hidden])), attention and feed-forward adding nothing."""
    embedding = _floats(tensors["model.embed_tokens.weight"])
    rms = lambda x: x / np.sqrt((x**2).mean(axis=1, keepdims=True) + 1e-6)  # noqa: E731
    projection = _floats(tensors["model.layers.4.eh_proj.weight"])[:, : embedding.shape[1]]
    hidden = rms(rms(embedding) @ projection.T)
    return np.asarray((hidden @ _floats(tensors["lm_head.weight"]).T).argmax(axis=1))


def test_partial_mtp_layer_misses_exactly_the_designed_bytes(partial_weights: dict[str, np.ndarray]) -> None:
    main = _logits(partial_weights, "lm_head.weight").argmax(axis=1)
    draft = _draft_tokens(partial_weights)
    bytes_ = slice(BYTE_TOKEN_OFFSET, BYTE_TOKEN_OFFSET + 256)
    misses = {i for i, (m, d) in enumerate(zip(main[bytes_], draft[bytes_], strict=True)) if m != d}
    assert misses == partial_draft_misses()
    assert all(draft[byte_token(b)] == byte_token(b + 2) for b in misses)


def test_full_mtp_layer_drafts_what_the_main_model_predicts() -> None:
    weights = tiny_model(MTP_FULL).weights()
    assert np.array_equal(_draft_tokens(weights), _logits(weights, "lm_head.weight").argmax(axis=1))
    assert np.array_equal(weights["lm_head.weight"], weights["model.layers.4.shared_head.head.weight"])


def test_sampling_probabilities_of_the_chain() -> None:
    probabilities = successor_probabilities()
    assert sum(probabilities) == pytest.approx(1) and probabilities[0] > probabilities[1] > probabilities[2]
    assert probabilities[0] == pytest.approx(1 / (1 + np.exp(-0.75) + np.exp(-1.75)))


@pytest.mark.parametrize(("k", "rate"), [(1, 2 / 3), (2, 3 / 4), (3, 1 / 2)])
def test_partial_acceptance_is_predicted(k: int, rate: float) -> None:
    counts = simulate_greedy_speculation(byte_token(ord("a")), 600, k, "partial")
    assert counts.acceptance_rate == pytest.approx(rate, abs=0.03)
    full = simulate_greedy_speculation(byte_token(ord("a")), 600, k, "full")
    assert full.acceptance_rate == 1 and set(full.tokens_per_step[1:-1]) == {k + 1}


def test_cached_mtp_model_has_the_mtp_layer(tmp_path: Path) -> None:
    import json

    path = ensure_tiny_model(tmp_path, "tiny-mtp")
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
