"""What a run's metadata says about its deployment: the user's --metadata first, then the hardware string, then what
the sweep detected; files from before any of this (and vLLM's) still load, with the gaps left unknown."""

from __future__ import annotations

from pathlib import Path

from deepserve.hardware.detect import LocalGpu
from deepserve.hardware.host import HostMeasurement
from deepserve.results.deployment import (
    cpu_deployment,
    gpu_deployment,
    model_config_for,
    read_deployment,
)
from deepserve.results.sweepdir import load_result_set

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"
HOST = HostMeasurement("box", "Test CPU", 2, 12.5, 100.0, None, "2026-11-22T00:00:00Z")


def test_an_old_sweep_index_reads_its_hardware_string_and_preset_model():
    recorded = read_deployment(load_result_set(FIXTURES / "h100_vllm_concurrency").metadata)
    assert recorded.devices == 8 and recorded.devices_source == "recorded hardware: 8x NVIDIA H100 SXM5 80GB"
    assert recorded.accelerator is not None and recorded.accelerator.name == "h100-sxm"
    assert recorded.spec is not None and recorded.spec.n_routed_experts == 256  # the AWQ preset's architecture
    assert recorded.gpu_hour_usd is None and not recorded.is_cpu_host


def test_vllm_result_files_without_hardware_leave_it_unknown():
    recorded = read_deployment(load_result_set(FIXTURES / "b200_vllm_loose").metadata)
    assert recorded.devices is None and recorded.accelerator is None
    assert recorded.model == "deepseek-ai/DeepSeek-V3-0324" and recorded.spec is not None


def test_user_metadata_wins_over_the_hardware_string_and_detection():
    metadata = {
        "hardware": "8x NVIDIA H100 80GB HBM3 (79 GiB)",
        "gpus": "4",
        "accelerator": "h200",
        "gpu_hour_usd": "$3.10",
        "deployment": gpu_deployment((LocalGpu(0, "NVIDIA H100 80GB HBM3", 81559),) * 8),
    }
    recorded = read_deployment(metadata)
    assert (recorded.devices, recorded.devices_source) == (4, "recorded (--metadata gpus)")
    assert recorded.accelerator is not None and recorded.accelerator.name == "h200"
    assert recorded.gpu_hour_usd == 3.10


def test_detected_gpus_are_used_when_nothing_else_says():
    recorded = read_deployment({"deployment": gpu_deployment((LocalGpu(0, "NVIDIA H200", 143771),) * 2)})
    assert recorded.devices == 2 and "nvidia-smi" in recorded.devices_source
    assert recorded.accelerator is not None and recorded.accelerator.name == "h200"


def test_a_cpu_host_records_its_measured_bandwidth_and_the_model_config():
    config = model_config_for(["/nonexistent/dir", "tiny"])
    assert config is not None and config["model_type"] == "deepseek_v3"
    deployment = {**cpu_deployment(HOST), "model_config": config}
    recorded = read_deployment({"hardware": "CPU only: 2 cores, Test CPU", "deployment": deployment})
    assert recorded.is_cpu_host and recorded.accelerator is None
    assert recorded.devices == 1 and recorded.host_bandwidth_gb_s == 12.5
    assert "Test CPU" in recorded.host_words and "2 cores" in recorded.host_words
    assert recorded.spec is not None and recorded.spec.num_layers == config["num_hidden_layers"]


def test_a_local_model_directory_gives_its_config(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "x", "num_hidden_layers": 2}')
    assert model_config_for([str(tmp_path)]) == {"model_type": "x", "num_hidden_layers": 2}
    assert model_config_for(["served-name-of-a-remote-model"]) is None


def test_values_that_do_not_parse_are_missing_not_errors():
    recorded = read_deployment(
        {"gpus": "eight", "gpu_hour_usd": "-1", "hardware": "a big box", "deployment": {"devices": "x", "host": 3}}
    )
    assert recorded.devices is None and recorded.gpu_hour_usd is None and recorded.accelerator is None
    assert recorded.spec is None and recorded.host_bandwidth_gb_s is None
