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


@pytest.mark.parametrize(
    ("name", "memory_gib", "fp4"),
    [("b200", 180, 9000), ("b300", 288, 13500), ("gb200", 186, 10000), ("gb300", 288, 15000), ("mi355x", 288, 10066.3)],
)
def test_fp4_dense_peaks_of_todays_gpus(name: str, memory_gib: float, fp4: float) -> None:
    """Datasheets: HGX B200 144 PF FP4 with sparsity per 8 GPUs, HGX B300 108 PF dense per 8, GB200 NVL72 1,440 PF
    with sparsity per 72, GB300 NVL72 1,440 PF dense per 72, MI355X 10 PF MXFP4 dense."""
    acc = get_accelerator(name)
    assert acc.memory_gib == memory_gib
    assert acc.dense_tflops["fp4"] == pytest.approx(fp4)


def test_gpus_without_fp4_units_have_no_fp4_peak() -> None:
    for name in ("h100", "h200", "h800", "h20", "mi300x", "mi325x", "a100"):
        assert "fp4" not in get_accelerator(name).dense_tflops


def test_h800_is_an_h100_with_a_narrower_nvlink() -> None:
    h800, h100 = get_accelerator("h800"), get_accelerator("h100")
    assert h800.dense_tflops == h100.dense_tflops and h800.memory_bandwidth_gb_s == h100.memory_bandwidth_gb_s
    assert h800.intra_node.bandwidth_gb_s == 200.0 < h100.intra_node.bandwidth_gb_s


def test_nvl72_racks_are_one_72_gpu_nvlink_domain() -> None:
    for name in ("gb200", "gb300"):
        acc = get_accelerator(name)
        assert acc.devices_per_node == 72 and acc.devices_per_host == 4
        assert acc.intra_node.kind == "nvlink5"
    assert get_accelerator("b200").devices_per_host == 8


def test_machines_count_as_nvlink_domains() -> None:
    """12 trays of an NVL72 rack are one NVLink domain, 36 trays two; on HGX nodes a machine is a domain."""
    gb200, h100 = get_accelerator("gb200"), get_accelerator("h100")
    assert gb200.nvlink_domains(48, 12) == 1 and gb200.nvlink_domains(144, 36) == 2
    assert gb200.nvlink_domains(144, 1) == 2  # more GPUs than one rack holds
    assert h100.nvlink_domains(16, 2) == 2 and h100.nvlink_domains(16, 1) == 2 and h100.nvlink_domains(8, 2) == 2


def test_rtx_pro_6000_is_a_pcie_blackwell() -> None:
    acc = get_accelerator("rtx-pro-6000")
    assert acc.architecture == "sm120" and acc.intra_node.kind == "pcie5" and acc.memory_gib == 96
    assert "estimate" in acc.notes  # FP8/BF16 dense are not printed on the datasheet


def test_every_datasheet_figure_cites_a_url() -> None:
    no_public_datasheet = {"h20", "cpu-xeon-8480"}  # NVIDIA posts no H20 datasheet; the CPU's AMX figure is derived
    for acc in ACCELERATORS:
        if acc.name not in no_public_datasheet:
            assert any("https://" in source for source in acc.sources), acc.name


@pytest.mark.parametrize(
    ("reported", "name"),
    [
        ("NVIDIA H800", "h800"),
        ("NVIDIA H20-3e", "h20-141gb"),  # the 141 GB H20: its own entry, not the 96 GB part's
        ("NVIDIA H20", "h20"),
        ("NVIDIA B300 SXM6 AC", "b300"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA GB300", "gb300"),
        ("AMD Instinct MI355X", "mi355x"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
    ],
)
def test_driver_names_of_new_gpus(reported: str, name: str) -> None:
    from deepserve.hardware.catalog import match_device_name

    match = match_device_name(reported)
    assert match is not None and match.name == name
