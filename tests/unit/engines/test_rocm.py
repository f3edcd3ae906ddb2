"""AMD Instinct GPUs: the platform a config is for, and what vLLM's and SGLang's commands carry on ROCm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.engines.platform import CUDA, ROCM, VLLM_ROCM_ENV, VLLM_ROCM_GFX950_ENV, gpu_platform, vllm_rocm_env
from deepserve.engines.registry import get_engine
from deepserve.models.resolve import ResolvedModel

R1 = ResolvedModel("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-R1", on_cpu=False)
TINY = ResolvedModel("/models/tiny", "deepserve/tiny-deepseek-v3", on_cpu=True)


@pytest.mark.parametrize(
    "fields, platform",
    [
        ({}, CUDA),
        ({"device": "rocm"}, ROCM),
        ({"gpu_type": "mi300x"}, ROCM),
        ({"gpu_type": "MI325X"}, ROCM),
        ({"gpu_type": "h200"}, CUDA),
        ({"device": "cuda", "gpu_type": "mi300x"}, CUDA),  # an explicit --device wins
    ],
)
def test_platform_from_device_or_gpu_type(fields: dict[str, str], platform: str) -> None:
    assert gpu_platform(EngineConfig(**fields)) == platform


def test_vllm_on_rocm_turns_aiter_on_and_keeps_its_flags() -> None:
    config = EngineConfig(gpu_type="mi300x", tensor_parallel_size=8, max_model_len=32768, trust_remote_code=True)
    rocm = get_engine("vllm").launch_spec(config, R1, None)
    cuda = get_engine("vllm").launch_spec(config.model_copy(update={"gpu_type": "h200"}), R1, None)
    assert rocm.env == {"VLLM_ROCM_USE_AITER": "1"}
    assert cuda.env == {}
    assert rocm.argv == cuda.argv  # the same vLLM flags: no --block-size 1, no retired variables
    assert rocm.shell_line().startswith("VLLM_ROCM_USE_AITER=1 vllm serve deepseek-ai/DeepSeek-R1")


def test_vllm_on_mi355x_leaves_aiters_linear_layers_off() -> None:
    config = EngineConfig(device="rocm", gpu_type="mi355x")
    assert vllm_rocm_env(config) == {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_LINEAR": "0"}
    assert get_engine("vllm").launch_spec(config, R1, None).env == vllm_rocm_env(config)


def test_the_cpu_build_gets_no_rocm_settings() -> None:
    env = get_engine("vllm").launch_spec(EngineConfig(device="rocm"), TINY, "python").env
    assert not any(name.startswith("VLLM_ROCM") for name in env)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_every_vllm_variable_set_on_rocm_exists_in_the_installed_vllm() -> None:
    """vLLM reads its variables from vllm/envs.py; a name it no longer has (VLLM_USE_TRITON_FLASH_ATTN, in older
    recipes) would be set and silently ignored."""
    import vllm.envs

    known = set(vllm.envs.environment_variables)
    for name in {**VLLM_ROCM_ENV, **VLLM_ROCM_GFX950_ENV}:
        assert name in known, name
    assert "VLLM_USE_TRITON_FLASH_ATTN" not in known


def test_sglang_on_rocm_uses_aiter() -> None:
    config = EngineConfig(engine="sglang", gpu_type="mi300x", tensor_parallel_size=8)
    rocm = get_engine("sglang").launch_spec(config, R1, None)
    assert rocm.env == {"SGLANG_USE_AITER": "1"}
    assert rocm.argv[rocm.argv.index("--attention-backend") + 1] == "aiter"
    cuda = get_engine("sglang").launch_spec(config.model_copy(update={"gpu_type": "h200"}), R1, None)
    assert cuda.env == {} and "--attention-backend" not in cuda.argv


def test_images_per_platform() -> None:
    assert get_engine("vllm").rocm_image == "vllm/vllm-openai-rocm:v0.32.0"
    assert (get_engine("sglang").rocm_image or "").startswith("lmsysorg/sglang:") and "rocm" in str(
        get_engine("sglang").rocm_image
    )
    assert get_engine("trtllm").rocm_image is None


def test_stream_interval_reaches_every_engine() -> None:
    config = EngineConfig(stream_interval=4)
    vllm = get_engine("vllm").launch_spec(config, R1, None).argv
    sglang = get_engine("sglang").launch_spec(config.model_copy(update={"engine": "sglang"}), R1, None).argv
    assert vllm[vllm.index("--stream-interval") + 1] == "4"
    assert sglang[sglang.index("--stream-interval") + 1] == "4"


def test_a_virtualenv_seeing_a_system_vllm_runs_the_systems_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ROCm image installs vLLM system-wide; bootstrap's virtualenv there sees its packages but has no
    `vllm` script of its own."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    system = tmp_path / "usr-local-bin"
    system.mkdir()
    (system / "vllm").write_text("#!/bin/sh\n")
    (system / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(system))
    argv = get_engine("vllm").launch_spec(EngineConfig(device="rocm"), R1, str(venv_python)).argv
    assert argv[:2] == ["vllm", "serve"]
    (venv_python.parent / "vllm").write_text("#!/bin/sh\n")
    argv = get_engine("vllm").launch_spec(EngineConfig(device="rocm"), R1, str(venv_python)).argv
    assert argv[0] == str(venv_python.parent / "vllm")
