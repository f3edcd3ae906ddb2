"""`deepserve model show` for V3.2 and V4: KV cache at 8K, 128K and 1M tokens and how it grows."""

from __future__ import annotations

import json

import pytest

from deepserve.cli.main import main


def _show(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["model", "show", *args]) == 0
    return capsys.readouterr().out


def _text(table: str) -> str:
    """The table's cells as one line of words (rows wrapped at the console's width joined again)."""
    return " ".join(table.replace("│", " ").split())


def test_v4_flash_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = _text(_show(capsys, "deepseek-ai/DeepSeek-V4-Flash"))
    assert "43 (0 dense, 43 MoE, the first 3 routed by token-id hash); 2 window only, 21 CSA" in out
    assert "284.3B; model card 284.0B" in out and "13.8B; model card 13.0B" in out
    assert "3,915 B of growth (3,850 B of entries, the rest page padding) + 26.1 MB fixed per request" in out
    # 8K: the fixed state dominates; 1M: the growth does (26.1 MB + 4,096 blocks of 1,002,240 B)
    assert "8K: 7,096 B/token (0.06 GB)" in out and "1M: 3,940 B/token (4.13 GB)" in out
    assert "fixed per request (window of 128 tokens)" in out and "grows with the context" in out
    assert "1 MTP layer(s)" in out


def test_v32_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = _text(_show(capsys, "v3.2"))
    assert "lightning indexer 64 heads x 128 picks the top 2048 positions" in out
    assert "KV cache / token (fp8_ds_mla) 48,068 B, every token alike" in out
    assert "128K: 48,068 B/token (6.30 GB)" in out
    assert "1M: beyond the model's 163,840 positions" in out


def test_v4_pro_json(capsys: pytest.CaptureFixture[str]) -> None:
    facts = json.loads(_show(capsys, "v4-pro", "--json"))
    assert facts["attention_kind"] == "compressed_sparse" and facts["num_layers"] == 61
    assert facts["n_routed_experts"] == 384 and facts["num_experts_per_tok"] == 6
    assert 1.56e12 < facts["total_params"] < 1.6e12 and 49e9 < facts["active_params"] < 51e9
    fp8 = facts["kv_cache_by_dtype"]["fp8"]
    assert 5_400 < fp8["content_bytes_per_token"] < 5_600  # ≈ 5.5 KB/token of entries
    assert fp8["fixed_bytes_per_sequence"] > 30e6
    per_token = fp8["bytes_per_token_at"]
    assert per_token["8192"] > per_token["131072"] > per_token["1048576"] > fp8["bytes_per_token"]
    assert facts["published"]["total_params"]["value"] == 1.6e12
    assert "recipes" in facts["published"]["total_params"]["source"]


def test_list_shows_every_current_release(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "list"]) == 0
    out = _text(capsys.readouterr().out)
    for name in ("DeepSeek-V3.1-Terminus", "DeepSeek-V3.2-Speciale", "DeepSeek-V4-Flash-0731", "DeepSeek-V4-Pro-0813"):
        assert name in out
    assert "48,068 (fp8_ds_mla)" in out and "26.1 MB" in out
