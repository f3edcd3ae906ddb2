"""TensorRT-LLM's command line and options file from an EngineConfig, checked against TensorRT-LLM's own option
definitions (tests/fixtures/trtllm/trtllm_options.json: its CLI contract and llm_args.py's fields, with their
sources and licence in trtllm_options.md): every flag written exists and its value has the flag's type; every YAML
key exists at its nesting with a value of its type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.engines.base import FILE_MARKER, LaunchSpec
from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.trtllm import options, parser_flags, speculative_options
from deepserve.errors import ConfigError
from deepserve.models.resolve import ResolvedModel

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "trtllm" / "trtllm_options.json"
DEFINITIONS = json.loads(FIXTURE.read_text())
R1 = ResolvedModel("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1", on_cpu=False)
R1_FP4 = ResolvedModel("nvidia/DeepSeek-R1-FP4", "nvidia/DeepSeek-R1-FP4", on_cpu=False)

# The recipe of NVIDIA's DeepSeek-R1 max-throughput run on 8 x H200 (attention DP8 + EP8), as a config.
THROUGHPUT: dict[str, Any] = dict(
    engine="trtllm",
    tensor_parallel_size=1,
    data_parallel_size=8,
    enable_expert_parallel=True,
    max_num_seqs=128,
    max_num_batched_tokens=1151,
    max_model_len=3072,
    gpu_memory_utilization=0.8,
    kv_cache_dtype="fp8",
    enable_prefix_caching=False,
    enable_chunked_prefill=True,
    block_size=32,
    kv_cache_memory_gib=60.0,
    dtype="bfloat16",
    stream_interval=10,
    trust_remote_code=True,
    gpu_type="h200",
    host="0.0.0.0",
    port=8000,
)


def launch(model: ResolvedModel = R1, python: str | None = None, **fields: Any) -> LaunchSpec:
    return get_engine("trtllm").launch_spec(EngineConfig(**{"engine": "trtllm", **fields}), model, python)


# ---- the definitions, as lookups -----------------------------------------------------------------------------------


def cli_flags() -> dict[str, dict[str, Any]]:
    """Every spelling of every `trtllm-serve` option → its definition."""
    return {flag: entry for entry in DEFINITIONS["cli"]["serve"].values() for flag in entry["flags"]}


def nested_definitions(section: str) -> dict[str, Any]:
    keys = [key for key in DEFINITIONS["yaml_nested"] if key == section or key.startswith(section + " (")]
    assert keys, f"no nested definition for {section}"
    return DEFINITIONS["yaml_nested"][keys[0]]


def value_fits(type_text: str, value: Any, choices: list[str] | None = None) -> bool:
    """Whether VALUE is of the type a definition names (its words: int, float, bool, str, Literal, choice, path)."""
    text = type_text.lower()
    if choices is not None and value not in choices:
        return False
    if isinstance(value, bool):
        return "bool" in text
    if isinstance(value, int):
        return "int" in text or "float" in text
    if isinstance(value, float):
        return "float" in text
    if isinstance(value, str):
        return any(word in text for word in ("str", "literal", "choice", "path"))
    if isinstance(value, dict):
        return "nested" in text or "config" in text or "dict" in text or "discriminated" in text
    return False


def check_flags(argv: list[str]) -> list[str]:
    """What is wrong with ARGV's flags against the CLI definitions (empty: nothing)."""
    flags, problems = cli_flags(), []
    position = 2  # trtllm-serve MODEL
    while position < len(argv):
        flag = argv[position]
        entry = flags.get(flag)
        if entry is None:
            problems.append(f"{flag}: not a trtllm-serve option")
            has_value = position + 1 < len(argv) and not argv[position + 1].startswith("--")
            position += 2 if has_value else 1
            continue
        if entry.get("is_flag"):
            position += 1
            continue
        value = argv[position + 1]
        typed: Any = value
        for cast in (int, float):
            try:
                typed = cast(value)
                break
            except ValueError:
                continue
        if not value_fits(entry["type"], typed, entry.get("choices")):
            problems.append(f"{flag} {value}: not a {entry['type']}")
        position += 2
    return problems


def check_yaml(data: dict[str, Any]) -> list[str]:
    top, problems = DEFINITIONS["yaml_top_level"], []
    for key, value in data.items():
        if key not in top:
            problems.append(f"{key}: not an LLM-API option")
            continue
        if isinstance(value, dict):
            nested = nested_definitions(key)
            for inner, inner_value in value.items():
                if inner not in nested:
                    problems.append(f"{key}.{inner}: not a field of {key}")
                elif not value_fits(nested[inner]["type"], inner_value, nested[inner].get("choices")):
                    problems.append(f"{key}.{inner} {inner_value!r}: not a {nested[inner]['type']}")
        elif not value_fits(top[key]["type"], value):
            problems.append(f"{key} {value!r}: not a {top[key]['type']}")
    return problems


def written_yaml(spec: LaunchSpec) -> dict[str, Any]:
    (text,) = spec.files.values()
    loaded = yaml.safe_load(text)
    assert isinstance(loaded, dict)
    return loaded


# ---- the command line ----------------------------------------------------------------------------------------------


def test_throughput_recipe_command_line() -> None:
    spec = launch(**THROUGHPUT)
    argv = spec.argv
    assert argv[:3] == ["trtllm-serve", "deepseek-ai/DeepSeek-R1", "--backend"]
    expected = {
        "--backend": "pytorch",
        "--tp_size": "8",  # attention-DP ranks count inside TensorRT-LLM's TP size
        "--ep_size": "8",
        "--pp_size": "1",
        "--max_batch_size": "128",
        "--max_num_tokens": "1151",
        "--max_seq_len": "3072",
        "--kv_cache_free_gpu_memory_fraction": "0.8",
        "--host": "0.0.0.0",
        "--port": "8000",
    }
    for flag, value in expected.items():
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--trust_remote_code" in argv
    (path,) = spec.files
    assert argv[argv.index("--extra_llm_api_options") + 1] == path == "/tmp/deepserve/trtllm-extra-options-8000.yaml"
    assert spec.ready_path == "/health" and spec.base_url == "http://127.0.0.1:8000/v1"


@pytest.mark.parametrize(
    "fields",
    [
        THROUGHPUT,
        {"tensor_parallel_size": 8, "max_num_seqs": 4, "enable_expert_parallel": True},
        {"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
        {},
    ],
)
def test_every_flag_exists_with_its_type(fields: dict[str, Any]) -> None:
    argv = launch(**{**fields, "engine": "trtllm"}).argv
    assert check_flags(argv) == []


def test_the_checker_catches_a_wrong_flag_and_a_wrong_type() -> None:
    assert check_flags(["trtllm-serve", "m", "--tensor-parallel-size", "8"]) == [
        "--tensor-parallel-size: not a trtllm-serve option"
    ]
    assert check_flags(["trtllm-serve", "m", "--tp_size", "eight"]) == ["--tp_size eight: not a int"]
    assert check_flags(["trtllm-serve", "m", "--backend", "tensorflow"]) == ["--backend tensorflow: not a choice"]


def test_extra_args_pass_through_after_the_options_file() -> None:
    argv = launch(extra_args=["--log_level", "debug"]).argv
    assert argv[-2:] == ["--log_level", "debug"]


# ---- the options file ----------------------------------------------------------------------------------------------


def test_throughput_recipe_options() -> None:
    data = written_yaml(launch(**THROUGHPUT))
    assert data["enable_attention_dp"] is True
    assert data["attention_dp_config"] == {"enable_balance": True, "batching_wait_iters": 0, "timeout_iters": 60}
    assert data["moe_config"] == {"backend": "CUTLASS"}  # Hopper FP8 in the DeepSeek-R1 guide's table
    assert data["cuda_graph_config"] == {"enable_padding": True, "max_batch_size": 128}
    assert data["kv_cache_config"] == {
        "dtype": "fp8",
        "enable_block_reuse": False,
        "tokens_per_block": 32,
        "max_gpu_total_bytes": 60 * 1024**3,
    }
    assert data["stream_interval"] == 10 and data["dtype"] == "bfloat16" and data["enable_chunked_prefill"] is True
    assert data["enable_iter_perf_stats"] is True and data["print_iter_log"] is False


@pytest.mark.parametrize(
    "fields, chunked",
    [
        ({}, True),  # the model's own context (128K-164K tokens) over trtllm-serve's 8,192-token step
        ({"max_model_len": 32768}, True),
        ({"max_model_len": 32768, "max_num_batched_tokens": 32768}, None),  # every prompt fits a step: its default
        ({"max_model_len": 4096}, None),
        ({"max_model_len": 32768, "enable_chunked_prefill": True}, True),
    ],
)
def test_chunked_prefill_where_a_prompt_may_outgrow_a_step(fields: dict[str, Any], chunked: bool | None) -> None:
    """Without chunked prefill TensorRT-LLM refuses a prompt longer than max_num_tokens (HTTP 400), so a service
    that promises a longer context turns it on."""
    data = written_yaml(launch(**fields))
    assert data.get("enable_chunked_prefill") is chunked


def test_chunked_prefill_turned_off_by_the_user_stays_off_and_says_what_is_refused() -> None:
    spec = launch(max_model_len=3072, max_num_batched_tokens=1151, enable_chunked_prefill=False)
    assert written_yaml(spec)["enable_chunked_prefill"] is False
    text = next(iter(spec.files.values()))
    assert "refuses prompts over 1151 tokens" in text
    assert "refuses" not in next(iter(launch(max_model_len=1024, enable_chunked_prefill=False).files.values()))


@pytest.mark.parametrize(
    "fields, model",
    [
        (THROUGHPUT, R1),
        ({"tensor_parallel_size": 8, "gpu_type": "b200"}, R1),
        ({"tensor_parallel_size": 8, "gpu_type": "b200", "kv_cache_dtype": "fp8_e4m3"}, R1_FP4),
        ({}, R1),
    ],
)
def test_every_yaml_key_exists_at_its_nesting_with_its_type(fields: dict[str, Any], model: ResolvedModel) -> None:
    assert check_yaml(written_yaml(launch(model, **{**fields, "engine": "trtllm"}))) == []


def test_the_yaml_checker_catches_a_wrong_key() -> None:
    assert check_yaml({"kv_cache_free_gpu_memory_fraction": 0.8}) == [
        "kv_cache_free_gpu_memory_fraction: not an LLM-API option"
    ]
    assert check_yaml({"moe_config": {"backend": "WIDEEP"}}) == ["moe_config.backend 'WIDEEP': not a Literal"]
    assert check_yaml({"kv_cache_config": {"free_gpu_memory_fraction": "high"}}) != []


def test_moe_backend_follows_the_gpu_and_weights() -> None:
    assert written_yaml(launch(gpu_type="b200"))["moe_config"]["backend"] == "DEEPGEMM"  # Blackwell FP8
    assert written_yaml(launch(R1_FP4, gpu_type="b200"))["moe_config"]["backend"] == "CUTLASS"  # Blackwell NVFP4
    assert written_yaml(launch(gpu_type="h100"))["moe_config"]["backend"] == "CUTLASS"


def test_mtp_and_parsers_when_the_config_gives_them() -> None:
    mtp = speculative_options("mtp", 3)
    assert mtp == {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3}}
    assert check_yaml(mtp) == []
    assert speculative_options(None, None) == {}
    with pytest.raises(ConfigError, match="MTP only"):
        speculative_options("eagle3", 2)
    assert parser_flags("deepseek_r1", "deepseek_v3") == [
        ("--reasoning_parser", "deepseek-r1"),
        ("--tool_parser", "deepseek_v3"),
    ]
    argv = ["trtllm-serve", "m", "--reasoning_parser", "deepseek-r1", "--tool_parser", "deepseek_v31"]
    assert check_flags(argv) == []
    assert "speculative_config" not in options(EngineConfig(engine="trtllm"), R1)  # nothing configured: nothing


# ---- where the file goes, and what cannot be expressed --------------------------------------------------------------


def test_on_this_machine_the_file_goes_to_deepserve_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_HOME", str(tmp_path))
    spec = launch(python="/opt/venv/bin/python", port=8123)
    (path,) = spec.files
    assert path == str(tmp_path / "engines" / "trtllm-extra-options-8123.yaml")
    assert spec.argv[0] == "trtllm-serve"  # none beside that Python: the one on PATH (NVIDIA's container)
    spec.write_files()
    assert yaml.safe_load(Path(path).read_text()) == written_yaml(spec)


def test_the_self_contained_script_writes_the_file_then_runs(tmp_path: Path) -> None:
    spec = launch(port=8000)
    script = spec.shell_script()
    assert script.startswith("mkdir -p /tmp/deepserve && cat > /tmp/deepserve/trtllm-extra-options-8000.yaml <<")
    assert script.count(FILE_MARKER) == 2 and script.splitlines()[-1].startswith("exec trtllm-serve ")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"device": "rocm"}, "no ROCm build"),
        ({"gpu_type": "mi300x"}, "no ROCm build"),
        ({"nnodes": 2, "master_addr": "10.0.0.1", "tensor_parallel_size": 8, "pipeline_parallel_size": 2}, "MPI"),
        ({"quantization": "fp8"}, "from the checkpoint"),
        ({"distributed_executor_backend": "ray"}, "Ray"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "no TensorRT-LLM counterpart"),
    ],
)
def test_what_tensorrt_llm_cannot_take_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        launch(**fields)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_decode_roles_are_refused_not_dropped(role: str) -> None:
    config = EngineConfig(engine="trtllm", role=role, kv_connector="NixlConnector")
    with pytest.raises(ConfigError, match="prefill/decode roles with TensorRT-LLM"):
        get_engine("trtllm").launch_spec(config, R1, None)
