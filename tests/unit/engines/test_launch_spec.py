"""Config → engine command line: what `deepserve serve` runs, for both engines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.sglang import default_chunked_prefill_size
from deepserve.errors import ConfigError
from deepserve.models.resolve import ResolvedModel

GPU_MODEL = ResolvedModel("deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3-0324", on_cpu=False)
CPU_MODEL = ResolvedModel("/models/tiny", "deepserve/tiny-deepseek-v3", on_cpu=True)


def vllm_argv(model: ResolvedModel = GPU_MODEL, **fields: object) -> list[str]:
    return get_engine("vllm").launch_spec(EngineConfig(**fields), model, "python").argv


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_on_gpu_carries_every_tuned_flag() -> None:
    argv = vllm_argv(
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        max_model_len=32768,
        max_num_seqs=128,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
        block_size=1,
        quantization="fp8",
        kv_cache_dtype="fp8",
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        trust_remote_code=True,
        port=9000,
    )
    assert argv[:3] == ["vllm", "serve", GPU_MODEL.source]  # the `vllm` script beside that Python
    expected = {
        "--tensor-parallel-size": "8",
        "--pipeline-parallel-size": "2",
        "--max-model-len": "32768",
        "--max-num-seqs": "128",
        "--max-num-batched-tokens": "8192",
        "--gpu-memory-utilization": "0.9",
        "--block-size": "1",
        "--quantization": "fp8",
        "--kv-cache-dtype": "fp8",
        "--port": "9000",
        "--served-model-name": GPU_MODEL.served_name,
    }
    for flag, value in expected.items():
        assert flag_value(argv, flag) == value, flag
    assert "--enable-chunked-prefill" in argv
    assert "--no-enable-prefix-caching" in argv
    assert "--trust-remote-code" in argv
    assert "--kv-cache-memory-bytes" not in argv  # on GPUs vLLM sizes the cache from gpu_memory_utilization


def test_vllm_leaves_unset_flags_to_the_engine_defaults() -> None:
    argv = vllm_argv()
    for flag in ("--tensor-parallel-size", "--max-model-len", "--quantization", "--enable-prefix-caching"):
        assert flag not in argv
    assert not any(arg.startswith("--no-") for arg in argv)


def test_vllm_on_cpu_sizes_context_and_kv_cache() -> None:
    spec = get_engine("vllm").launch_spec(EngineConfig(), CPU_MODEL, "python")
    assert flag_value(spec.argv, "--max-model-len") == "32768"
    assert flag_value(spec.argv, "--kv-cache-memory-bytes") == str(1024**3)
    assert spec.base_url == "http://127.0.0.1:8000/v1"
    explicit = vllm_argv(CPU_MODEL, max_model_len=16384, kv_cache_memory_gib=0.5)
    assert flag_value(explicit, "--max-model-len") == "16384"
    assert flag_value(explicit, "--kv-cache-memory-bytes") == str(512 * 1024**2)


def test_vllm_on_cpu_gives_a_v4_checkpoint_the_kv_cache_its_longest_request_needs(tmp_path: Path) -> None:
    """Without AMX, vLLM's CPU build asked 1.18 GiB for one 32,768-token request of the tiny V4 and refused 1 GiB."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    v4 = replace(CPU_MODEL, source=str(tmp_path))
    assert flag_value(vllm_argv(v4), "--kv-cache-memory-bytes") == str(2 * 1024**3)
    assert flag_value(vllm_argv(v4, kv_cache_memory_gib=0.5), "--kv-cache-memory-bytes") == str(512 * 1024**2)


def test_passthrough_arguments_come_last_unchanged() -> None:
    argv = vllm_argv(extra_args=["--speculative-config", '{"method": "mtp"}'])
    assert argv[-2:] == ["--speculative-config", '{"method": "mtp"}']


def test_base_url_for_wildcard_and_ipv6_hosts() -> None:
    engine = get_engine("vllm")
    assert engine.launch_spec(EngineConfig(host="0.0.0.0"), GPU_MODEL, "p").base_url == "http://127.0.0.1:8000/v1"
    assert engine.launch_spec(EngineConfig(host="::1"), GPU_MODEL, "p").base_url == "http://[::1]:8000/v1"


def test_sglang_maps_the_same_config_to_its_own_flags() -> None:
    config = EngineConfig(  # DP attention over 8 GPUs: one GPU of TP per replica, as vLLM counts it
        engine="sglang",
        tensor_parallel_size=1,
        data_parallel_size=8,
        enable_expert_parallel=True,
        max_model_len=32768,
        max_num_seqs=256,
        gpu_memory_utilization=0.85,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        trust_remote_code=True,
    )
    argv = get_engine("sglang").launch_spec(config, GPU_MODEL, "python").argv
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", GPU_MODEL.source]
    assert flag_value(argv, "--tp-size") == "8"  # SGLang counts the DP-attention ranks inside its TP size
    assert flag_value(argv, "--dp-size") == "8"
    assert flag_value(argv, "--ep-size") == "8"
    assert "--enable-dp-attention" in argv
    assert flag_value(argv, "--context-length") == "32768"
    assert flag_value(argv, "--max-running-requests") == "2048"  # SGLang counts every DP rank; ours is per rank
    assert flag_value(argv, "--mem-fraction-static") == "0.85"
    assert flag_value(argv, "--chunked-prefill-size") == "-1"
    assert "--disable-radix-cache" in argv
    assert "--trust-remote-code" in argv


def test_unknown_engine_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="valid: sglang, trtllm, vllm"):
        get_engine("tgi")


def test_phases_are_read_from_vllm_log_lines() -> None:
    engine = get_engine("vllm")
    assert engine.phase_of("(Worker pid=1) INFO [default_loader.py:501] Loading weights took 0.04 seconds") == (
        "loading weights"
    )
    assert engine.phase_of("INFO:     Application startup complete.") == "starting API server"
    assert engine.phase_of("some unrelated line") is None


@pytest.mark.parametrize(
    ("memory_gib", "version", "tokens"),
    [
        (141.0, None, 8192),  # H200, today's SGLang
        (180.0, None, 16384),  # B200
        (180.0, (0, 4, 6), 8192),  # before 0.4.7 every GPU of 25 GB or more got 8,192
        (192.0, (0, 4, 10), 16384),  # MI300X from 0.4.7
        (40.0, None, 4096),  # the 4,096 tier of 0.5.4 on
        (40.0, (0, 5, 2), 8192),
        (20.0, (0, 4, 3), 2048),
    ],
)
def test_sglangs_own_chunk_follows_its_version_and_the_gpus_memory(memory_gib, version, tokens) -> None:
    assert default_chunked_prefill_size(memory_gib, version) == tokens
