"""AMD Instinct GPUs as amd-smi and rocm-smi report them: the parsers against the recorded shapes in
tests/fixtures/amd/ (see its README for their sources), and detection with stand-in tools on PATH."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve.hardware.catalog import match_device_name
from deepserve.hardware.detect import (
    AMD,
    LocalGpu,
    gpu_vendor,
    has_gpu,
    local_gpus,
    parse_amd_smi_static,
    parse_amd_smi_version,
    parse_rocm_smi,
    rocm_version,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "amd"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_amd_smi_gpu_data_wrapper_mi300x() -> None:
    gpus = parse_amd_smi_static(fixture("amd_smi_static_mi300x.json"))
    assert len(gpus) == 8
    assert gpus[0] == LocalGpu(0, "AMD Instinct MI300X", 196592, AMD, "gfx942")
    assert [gpu.index for gpu in gpus] == list(range(8))
    found = match_device_name(gpus[0].name)
    assert found is not None and found.name == "mi300x"


def test_amd_smi_bare_list_of_older_releases_mi325x() -> None:
    gpus = parse_amd_smi_static(fixture("amd_smi_static_mi325x_list.json"))
    assert len(gpus) == 8
    assert gpus[3] == LocalGpu(3, "AMD Instinct MI325X", 262128, AMD, "gfx942")
    assert gpus[3].memory_mib // 1024 == 255  # 256 GB less the driver's reserve, in GiB
    found = match_device_name(gpus[3].name)
    assert found is not None and found.name == "mi325x"


def test_amd_smi_mi355x_and_an_unreadable_market_name() -> None:
    gpus = parse_amd_smi_static(fixture("amd_smi_static_mi355x.json"))
    assert gpus[0] == LocalGpu(0, "AMD Instinct MI355X", 294896, AMD, "gfx950")
    # N/A is the tool's placeholder, not a name: the graphics target stands in
    assert gpus[7].name == "AMD gfx950"
    assert gpus[7].arch == "gfx950"


def test_amd_smi_with_no_gpu_and_garbage() -> None:
    assert parse_amd_smi_static(fixture("amd_smi_static_none.json")) == ()
    assert parse_amd_smi_static("AMD-SMI: could not initialise the driver") == ()
    assert parse_amd_smi_static('{"error": "no permission"}') == ()


def test_amd_smi_size_as_a_string_and_in_bytes() -> None:
    as_text = '[{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X"}, "vram": {"size": "196592 MB"}}]'
    in_bytes = '[{"gpu": 0, "asic": {"market_name": "X"}, "vram": {"size": {"value": 34359738368, "unit": "B"}}}]'
    assert parse_amd_smi_static(as_text)[0].memory_mib == 196592
    assert parse_amd_smi_static(in_bytes)[0].memory_mib == 32768


def test_rocm_smi_cards() -> None:
    gpus = parse_rocm_smi(fixture("rocm_smi_mi300x.json"))
    assert len(gpus) == 8
    assert gpus[0] == LocalGpu(0, "AMD Instinct MI300X", 196592, AMD, "gfx942")


def test_rocm_smi_lower_case_keys_system_wrapper_and_card_order() -> None:
    text = (
        '{"system": {"card1": {"Card series": "AMD Instinct MI300X", "VRAM Total Memory (B)": "206141652992"},'
        ' "card0": {"Card series": "AMD Instinct MI300X", "VRAM Total Memory (B)": "206141652992"}}}'
    )
    assert [gpu.index for gpu in parse_rocm_smi(text)] == [0, 1]
    assert parse_rocm_smi("not json") == ()


def test_rocm_version_from_amd_smi() -> None:
    assert parse_amd_smi_version(fixture("amd_smi_version.json")) == "7.2.0"
    assert parse_amd_smi_version('{"amdsmi": {"rocm_version": "6.4.1"}}') == "6.4.1"
    assert parse_amd_smi_version("[]") is None


# ---- detection with stand-in tools on PATH --------------------------------------------------------------------------


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("PATH", str(tmp_path))
    local_gpus.cache_clear()
    yield tmp_path
    local_gpus.cache_clear()


def tool(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_amd_smi_on_path_finds_the_gpus(on_path: Path) -> None:
    static = FIXTURES / "amd_smi_static_mi300x.json"
    tool(on_path, "amd-smi", f'[ "$1" = static ] && /bin/cat {static} && exit 0\nexit 2\n')
    assert len(local_gpus()) == 8
    assert has_gpu() and gpu_vendor() == AMD


def test_amd_smi_json_is_read_despite_a_failing_exit(on_path: Path) -> None:
    # amd-smi exits non-zero when one section of one GPU cannot be read, after printing the rest
    tool(on_path, "amd-smi", f"/bin/cat {FIXTURES / 'amd_smi_static_mi355x.json'}\nexit 1\n")
    assert len(local_gpus()) == 8


def test_rocm_smi_when_amd_smi_fails(on_path: Path) -> None:
    tool(on_path, "amd-smi", "echo 'amdsmi_init failed' >&2\nexit 1\n")
    tool(on_path, "rocm-smi", f"/bin/cat {FIXTURES / 'rocm_smi_mi300x.json'}\n")
    gpus = local_gpus()
    assert len(gpus) == 8 and gpus[0].vendor == AMD


def test_nvidia_comes_first_and_nothing_means_no_gpu(on_path: Path) -> None:
    assert local_gpus() == () and gpu_vendor() is None
    local_gpus.cache_clear()
    tool(on_path, "nvidia-smi", "printf '0, NVIDIA H200, 143771\\n'\n")
    tool(on_path, "amd-smi", f"/bin/cat {FIXTURES / 'amd_smi_static_mi300x.json'}\n")
    assert local_gpus() == (LocalGpu(0, "NVIDIA H200", 143771),)


def test_rocm_version_from_the_tool_or_the_install(on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool(on_path, "amd-smi", f'[ "$1" = version ] && /bin/cat {FIXTURES / "amd_smi_version.json"}\n')
    assert rocm_version() == "7.2.0"
    (on_path / "amd-smi").unlink()
    info = on_path / "version"
    info.write_text("6.4.1-120\n")
    monkeypatch.setattr("deepserve.hardware.detect.ROCM_VERSION_FILE", info)
    assert rocm_version() == "6.4.1"
    monkeypatch.setattr("deepserve.hardware.detect.ROCM_VERSION_FILE", on_path / "missing")
    assert rocm_version() is None
