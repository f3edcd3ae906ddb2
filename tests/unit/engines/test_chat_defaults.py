"""Each model's reasoning and tool-call parsers and tokenizer mode, per engine: defaults, overrides, and every name
checked against what the engines register."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from deepserve.cli.main import main
from deepserve.engines.chat_defaults import SGLANG_DEFAULTS, VLLM_DEFAULTS
from deepserve.engines.config import EngineConfig
from deepserve.engines.sglang import SglangEngine
from deepserve.engines.vllm import VllmEngine
from deepserve.errors import ConfigError
from deepserve.models.chat_format import ChatFormat
from deepserve.models.resolve import ResolvedModel
from deepserve.serve import service_plan as service

FIXTURES = Path(__file__).parents[2] / "fixtures"
R1 = ResolvedModel("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1", on_cpu=False)
V4 = ResolvedModel("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Flash", on_cpu=False)


def _vllm_argv(config: EngineConfig, model: ResolvedModel = R1) -> list[str]:
    return VllmEngine().launch_spec(config, model, None).argv


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_every_deepseek_format_has_defaults_on_both_engines() -> None:
    deepseek = set(ChatFormat) - {ChatFormat.OTHER}
    assert set(VLLM_DEFAULTS) == deepseek == set(SGLANG_DEFAULTS)


def test_r1_gets_its_reasoning_and_tool_parsers() -> None:
    argv = _vllm_argv(EngineConfig(model=R1.source))
    assert _flag(argv, "--reasoning-parser") == "deepseek_r1"
    assert _flag(argv, "--tool-call-parser") == "deepseek_v3" and "--enable-auto-tool-choice" in argv
    assert "--tokenizer-mode" not in argv  # R1's Hugging Face tokenizer and template: vLLM's default


def test_v4_gets_its_tokenizer_mode_and_parsers_on_both_engines() -> None:
    argv = _vllm_argv(EngineConfig(model=V4.source), V4)
    assert [_flag(argv, f) for f in ("--tokenizer-mode", "--reasoning-parser", "--tool-call-parser")] == [
        "deepseek_v4",
        "deepseek_v4",
        "deepseek_v4",
    ]
    sglang = SglangEngine().launch_spec(EngineConfig(engine="sglang", model=V4.source), V4, None).argv
    assert (_flag(sglang, "--reasoning-parser"), _flag(sglang, "--tool-call-parser")) == ("deepseek-v4", "deepseekv4")


def test_overrides_replace_or_switch_off_each_default() -> None:
    argv = _vllm_argv(EngineConfig(model=R1.source, reasoning_parser="none", tool_call_parser="deepseek_v31"))
    assert "--reasoning-parser" not in argv and _flag(argv, "--tool-call-parser") == "deepseek_v31"
    argv = _vllm_argv(EngineConfig(model=R1.source, enable_auto_tool_choice=False))
    assert "--enable-auto-tool-choice" not in argv and _flag(argv, "--tool-call-parser") == "deepseek_v3"
    with pytest.raises(ConfigError, match="needs a tool-call parser"):
        _vllm_argv(EngineConfig(model=R1.source, tool_call_parser="none", enable_auto_tool_choice=True))


def test_server_wide_chat_template_options_are_vllm_only() -> None:
    config = EngineConfig(model=V4.source, default_chat_template_kwargs='{"thinking": false}')
    assert config.default_chat_template_kwargs == {"thinking": False}
    assert json.loads(_flag(_vllm_argv(config, V4), "--default-chat-template-kwargs") or "") == {"thinking": False}
    with pytest.raises(ConfigError, match="per request"):
        SglangEngine().launch_spec(config.model_copy(update={"engine": "sglang"}), V4, None)
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(default_chat_template_kwargs="{thinking")


def test_a_model_of_no_known_format_gets_no_chat_flags() -> None:
    other = ResolvedModel("Qwen/Qwen3-8B", "Qwen/Qwen3-8B", on_cpu=False)
    argv = _vllm_argv(EngineConfig(model=other.source), other)
    assert not {"--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice"} & set(argv)


def test_headless_workers_get_no_chat_flags() -> None:
    config = EngineConfig(model=R1.source, nnodes=2, node_rank=1, master_addr="10.0.0.1", pipeline_parallel_size=2)
    assert "--reasoning-parser" not in _vllm_argv(config)


def test_r1_dry_run_shows_its_reasoning_parser(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    assert main(["serve", "--model", "deepseek-ai/DeepSeek-R1", "--dry-run"]) == 0
    assert "--reasoning-parser deepseek_r1" in capsys.readouterr().out


def test_v32_on_cpu_is_refused_before_start_with_vllms_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    assert main(["serve", "--model", "deepseek-ai/DeepSeek-V3.2-Exp"]) == 2
    assert "Sparse Attention is not supported on CPU" in capsys.readouterr().err


def test_v32_gpu_dry_run_has_its_tokenizer_mode_and_parsers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    argv = ["serve", "--model", "deepseek-ai/DeepSeek-V3.2-Exp", "--dry-run", "--device", "cuda"]
    assert main([*argv, "--tensor-parallel-size", "8", "--gpu-type", "h200"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("vllm serve"))
    assert "--tokenizer-mode deepseek_v32 --reasoning-parser deepseek_v3 --tool-call-parser deepseek_v32" in line


# ---- names the engines register --------------------------------------------------------------------------------


def _vllm_registry(relative_path: str, variable: str) -> set[str]:
    """The keys of a registry dict in the installed vLLM's source (read, not imported: importing costs seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / relative_path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == variable for t in targets):
                return {
                    key.value for key in node.value.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)
                }
    raise AssertionError(f"{variable} not found in vllm/{relative_path}")


def test_vllm_defaults_name_what_the_installed_vllm_registers() -> None:
    reasoning = _vllm_registry("reasoning/__init__.py", "_REASONING_PARSERS_TO_REGISTER")
    tools = _vllm_registry("tool_parsers/__init__.py", "_TOOL_PARSERS_TO_REGISTER")
    tokenizers = _vllm_registry("tokenizers/registry.py", "_VLLM_TOKENIZERS")
    for flags in VLLM_DEFAULTS.values():
        assert flags.reasoning_parser in reasoning | {None}
        assert flags.tool_call_parser in tools | {None}
        assert flags.tokenizer_mode in tokenizers | {None}


def test_sglang_defaults_name_what_sglang_registers() -> None:
    names = json.loads((FIXTURES / "sglang" / "parser_names.json").read_text())
    for flags in SGLANG_DEFAULTS.values():
        assert flags.reasoning_parser in {*names["reasoning_parser_names"]["names"], None}
        assert flags.tool_call_parser in {*names["tool_call_parser_names"]["names"], None}
