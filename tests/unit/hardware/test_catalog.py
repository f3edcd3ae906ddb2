from __future__ import annotations

import pytest

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import ACCELERATORS, accelerator_names, get_accelerator, get_network


def test_issue_names_resolve_case_insensitively() -> None:
    for name in ("h100", "H100", "h100-pcie", "a100-80gb", "A100-40GB", "h200", "h20", "b200", "mi300x", "MI325X"):
        assert get_accelerator(name).name in accelerator_names()
    assert get_accelerator("l40s").name == "l40s"
    assert get_accelerator("rtx-6000-ada").name == "rtx-6000-ada"
    assert get_accelerator("cpu").hardware_class == "cpu"


def test_h100_means_the_sxm_part() -> None:
    assert get_accelerator("h100").name == "h100-sxm"
    assert get_accelerator("h100").intra_node.kind == "nvlink4"
    assert get_accelerator("h100-pcie").intra_node.kind == "pcie5"


def test_published_hardware_labels_resolve() -> None:
    for label in ("H100-SXM5-80GB", "B200", "H200-SXM5-141GB", "MI300X-192GB"):
        get_accelerator(label)


def test_unknown_gpu_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError) as error:
        get_accelerator("h1000")
    message = str(error.value)
    assert "h1000" in message
    for name in accelerator_names():
        assert name in message


def test_every_entry_has_sources_and_dense_16bit_flops() -> None:
    for acc in ACCELERATORS:
        assert acc.sources and all(source.strip() for source in acc.sources)
        assert acc.peak_tflops("bf16") > 0
        assert acc.memory_gib > 0 and acc.memory_bandwidth_gb_s > 0
        assert acc.intra_node.bandwidth_gb_s > 0


def test_flops_are_dense_not_sparse() -> None:
    # Datasheets quote 3,958 TFLOPS FP8 for H100 SXM and 9 PFLOPS FP8 per B200 *with sparsity*.
    assert get_accelerator("h100").dense_tflops["fp8"] == pytest.approx(1978.9)
    assert get_accelerator("b200").dense_tflops["fp8"] == pytest.approx(4500)
    assert get_accelerator("h100").dense_tflops["bf16"] == pytest.approx(989.4)


def test_fp8_on_a_gpu_without_fp8_units_runs_at_16_bit_rate() -> None:
    a100 = get_accelerator("a100-80gb")
    assert "fp8" not in a100.dense_tflops
    assert a100.peak_tflops("fp8") == a100.dense_tflops["bf16"]


def test_networks() -> None:
    assert get_network("ib").name == "ib"
    assert get_network("infiniband-ndr").name == "ib" and get_network("roce-400g").name == "roce"  # old names
    assert get_network("ethernet-100g").name == "tcp"
    assert get_network("ethernet").bandwidth_gb_s_per_node == pytest.approx(12.5)
    with pytest.raises(ConfigError, match="valid"):
        get_network("carrier-pigeon")


@pytest.mark.parametrize(
    ("reported", "name"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H20", "h20"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ],
)
def test_driver_device_names_match_catalog_entries(reported: str, name: str) -> None:
    from deepserve.hardware.catalog import match_device_name

    found = match_device_name(reported)
    assert found is not None and found.name == name


def test_unknown_device_name_matches_nothing() -> None:
    from deepserve.hardware.catalog import match_device_name

    assert match_device_name("Voodoo 3 3000") is None
