"""The config tree's precedence (defaults ← file ← environment ← flags) and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError


def test_defaults_then_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "deepserve.yaml"
    file.write_text("engine:\n  port: 9000\n  max_model_len: 4096\n  max_num_seqs: 64\n")
    monkeypatch.setenv("DEEPSERVE_ENGINE__MAX_MODEL_LEN", "8192")
    monkeypatch.setenv("DEEPSERVE_ENGINE__ENABLE_PREFIX_CACHING", "false")
    config = load_section(EngineConfig, "engine", file, {"max_num_seqs": 128, "block_size": None})
    assert config.port == 9000  # file
    assert config.max_model_len == 8192  # environment beats file
    assert config.max_num_seqs == 128  # flag beats file
    assert config.enable_prefix_caching is False
    assert config.block_size is None  # a flag not given does not override
    assert config.engine == "vllm"  # default


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "c.json"
    file.write_text('{"engine": {"tensor_parallel_size": 8}}')
    monkeypatch.setenv("DEEPSERVE_CONFIG", str(file))
    assert load_section(EngineConfig, "engine").tensor_parallel_size == 8


def test_unknown_environment_variable_lists_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_ENGINE__MAX_LEN", "10")
    with pytest.raises(ConfigError, match="DEEPSERVE_ENGINE__MAX_LEN.*DEEPSERVE_ENGINE__MAX_MODEL_LEN"):
        load_section(EngineConfig, "engine")


def test_invalid_values_say_which_field_and_what_was_given(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("engine:\n  gpu_memory_utilization: 1.5\n")
    with pytest.raises(ConfigError, match=r"engine.gpu_memory_utilization: .*less than or equal to 1.*1.5"):
        load_section(EngineConfig, "engine", file)


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("engine:\n  tensor_paralel_size: 8\n")
    with pytest.raises(ConfigError, match="tensor_paralel_size"):
        load_section(EngineConfig, "engine", file)


def test_missing_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_section(EngineConfig, "engine", tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_section(EngineConfig, "engine", bad)


def test_a_check_across_fields_reads_as_its_own_message() -> None:
    """A model validator's error has no field and its input is the whole section: neither belongs in the message."""
    from deepserve.bench.config import LoadConfig

    with pytest.raises(ConfigError) as caught:
        load_section(LoadConfig, "bench_load", overrides={"request_rate": 20.0, "ramp_up_strategy": "linear"})
    message = str(caught.value)
    assert "bench_load: " in message and "Value error" not in message and "{" not in message
