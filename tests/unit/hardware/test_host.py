"""The host measurement is made once per machine and reused; a different machine's file is not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepserve.hardware import host
from deepserve.hardware.catalog import host_accelerator
from deepserve.plan.kernels import kernel_rates


@pytest.fixture
def quick_measure(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def fake() -> host.HostMeasurement:
        calls.append(1)
        return host.HostMeasurement("h", "cpu", 2, 40.0, 100.0, None, "2026-11-22T00:00:00Z")

    monkeypatch.setattr(host, "measure_host", fake)
    return calls


def test_measured_once_then_reused(isolated_home: Path, quick_measure: list[int]) -> None:
    first = host.measured_host()
    second = host.measured_host()
    assert first == second and len(quick_measure) == 1
    assert json.loads(host.cache_path().read_text())["key"] == host.host_key()


def test_another_hosts_file_is_measured_again(isolated_home: Path, quick_measure: list[int]) -> None:
    host.measured_host()
    data = json.loads(host.cache_path().read_text())
    host.cache_path().write_text(json.dumps({**data, "key": "elsewhere|cpu|64"}))
    host.measured_host()
    assert len(quick_measure) == 2


def test_a_measurement_is_the_median_of_its_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared VM's linear rate flips between spells; one probe in a slow one must not price every later plan."""
    linear = iter([290.0, 960.0, 900.0])
    bandwidth = iter([20.0, 10.0, 30.0])

    def probe() -> host.HostMeasurement:
        return host.HostMeasurement("h", "cpu", 2, next(bandwidth), 100.0, next(linear), "2026-11-29T12:00:00Z")

    monkeypatch.setattr(host, "probe_host", probe)
    pauses: list[float] = []
    monkeypatch.setattr(host.time, "sleep", pauses.append)
    measured = host.measure_host(probes=3, pause_s=2.0)
    assert measured.bf16_gflops == 900.0 and measured.memory_bandwidth_gb_s == 20.0
    assert measured.bf16_gflops_range == (290.0, 960.0) and measured.probes == 3
    assert measured.attention_gflops is None  # a rate no probe measured stays unmeasured
    assert pauses == [2.0, 2.0]
    words = " ".join(host_accelerator(measured).sources)
    assert "median of 3 probes, the linear from 290.0 to 960.0" in words


def test_the_stored_spread_reads_back_as_measured(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probes = [host.HostMeasurement("h", "cpu", 2, 20.0, 100.0, rate, "t") for rate in (300.0, 500.0, 400.0)]
    monkeypatch.setattr(host, "measure_host", lambda: host.median_measurement(probes))
    first = host.measured_host()
    assert host.measured_host() == first and first.bf16_gflops_range == (300.0, 500.0)


def test_real_measurement_is_positive() -> None:
    bandwidth = host.copy_bandwidth_gb_s(nbytes=8 * 1024**2, repeats=2)
    gflops = host.numpy_matmul_gflops(size=128, repeats=2)
    assert bandwidth > 0.1 and gflops > 0.01


def _cpuinfo(cores_of_cpus: list[int]) -> str:
    """/proc/cpuinfo text where logical CPU i sits on physical core cores_of_cpus[i] of package 0."""
    return "\n\n".join(
        f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {core}\nmodel name\t: Test CPU"
        for cpu, core in enumerate(cores_of_cpus)
    )


@pytest.mark.parametrize(
    ("cores_of_cpus", "node", "expected"),
    [
        ([0, 1], {0, 1}, 1),  # this machine: two cores, one left to the worker
        ([0], {0}, 1),  # a single core is still one thread
        ([0, 1, 2, 3, 0, 1, 2, 3], set(range(8)), 3),  # SMT-2: one thread per physical core
        ([0, 1, 2, 3, 4, 5, 6, 7], {0, 1, 2, 3}, 3),  # two NUMA nodes: the worker binds to its own node's cores
    ],
)
def test_engine_threads_follow_vllm_auto_binding(cores_of_cpus: list[int], node: set[int], expected: int) -> None:
    allowed = set(range(len(cores_of_cpus)))
    assert host.engine_threads(_cpuinfo(cores_of_cpus), allowed, node) == expected


def test_cpu_list_ranges_parse() -> None:
    assert host.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


def test_bf16_rate_measured_on_the_threads_asked_and_torch_left_as_found() -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    assert (host.torch_bf16_matmul_gflops((16, 32, 32), repeats=1, threads=1) or 0) > 0
    assert torch.get_num_threads() == before


def test_prompt_attention_rate_measured_on_the_threads_asked() -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    assert (host.torch_prefill_attention_gflops((2, 64, 32, 16), repeats=1, threads=1) or 0) > 0
    assert torch.get_num_threads() == before


def test_the_hosts_measured_attention_replaces_the_kernel_tables_figure() -> None:
    from deepserve.hardware.catalog import host_accelerator
    from deepserve.plan.kernels import kernel_rates

    measured = host.HostMeasurement("h", "cpu", 2, 27.0, 150.0, 15.0, "2026-11-23T00:00:00Z", attention_gflops=24.0)
    attention = kernel_rates(host_accelerator(measured), "bf16").rate("mla_prefill")
    assert attention.compute_efficiency == pytest.approx(1.6) and attention.measured
    without = host.HostMeasurement("h", "cpu", 2, 27.0, 150.0, 15.0, "2026-11-23T00:00:00Z")
    assert kernel_rates(host_accelerator(without), "bf16").rate("mla_prefill").compute_efficiency == 1.0


def test_the_hosts_measured_decode_kernel_sets_both_sides_of_decode_attention() -> None:
    """On an AMX host the decode kernel's cache rate (few heads) and FLOP rate (many heads) replace the kernel
    table's "as dense" for mla_decode; the host then counts as x86-amx, the architecture vLLM's AMX path needs."""
    from deepserve.hardware.catalog import HOST_AMX_ARCHITECTURE, host_accelerator
    from deepserve.plan.kernels import kernel_rates

    measured = host.HostMeasurement(
        "h", "cpu", 2, 20.0, 150.0, 1000.0, "2026-11-29T00:00:00Z", attention_gflops=110.0, amx=True,
        attention_kernel="amx_mla", decode_attention_gb_s=4.0, decode_attention_gflops=160.0,
    )  # fmt: skip
    accelerator = host_accelerator(measured)
    decode = kernel_rates(accelerator, "bf16").rate("mla_decode")
    assert (decode.memory_efficiency, decode.compute_efficiency) == (pytest.approx(0.2), pytest.approx(0.16))
    assert decode.measured and accelerator.architecture == HOST_AMX_ARCHITECTURE
    assert "AMX MLA" in accelerator.sources[0]
    plain = host_accelerator(host.HostMeasurement("h", "cpu", 2, 20.0, 150.0, 15.0, "2026-11-23T00:00:00Z"))
    assert kernel_rates(plain, "bf16").rate("mla_decode").memory_efficiency == 1.0 and plain.architecture == ""


def test_vllms_amx_mla_kernels_are_timed_where_the_cpu_has_them() -> None:
    """The kernels vLLM's AMX_MLA backend runs, called as it calls them, at small shapes; None on other CPUs."""
    prefill = host.vllm_amx_prefill_attention_gflops((2, 64, 192, 128), repeats=1, threads=1)
    decode = host.vllm_amx_decode_attention(sequences=2, positions=64, heads=(4, 16), threads=1)
    if host._vllm_amx_ops() is None:
        assert prefill is None and decode is None
        return
    assert prefill is not None and prefill > 0
    assert decode is not None and decode.cache_gb_s > 0 and decode.gflops > 0


def test_a_host_without_amx_times_the_reference_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU build decodes MLA with its reference kernel where the CPU has no AMX tiles; charged at the copy
    bandwidth instead, the profile priced decode steps at 512-token prompts a quarter too fast on an AVX512 EPYC."""
    monkeypatch.setattr(host, "cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setattr(host, "copy_bandwidth_gb_s", lambda threads: 27.0)
    monkeypatch.setattr(host, "numpy_matmul_gflops", lambda: 190.0)
    monkeypatch.setattr(host, "torch_bf16_matmul_gflops", lambda threads: 210.0)
    monkeypatch.setattr(host, "torch_prefill_attention_gflops", lambda threads: 31.0)
    monkeypatch.setattr(host, "vllm_reference_decode_attention", lambda threads: host.DecodeAttentionRates(3.3, 46.0))

    def no_amx(**_: object) -> None:
        raise AssertionError("an AMX kernel timed on a CPU without AMX tiles")

    monkeypatch.setattr(host, "vllm_amx_decode_attention", no_amx)
    monkeypatch.setattr(host, "vllm_amx_prefill_attention_gflops", no_amx)
    probe = host.probe_host()
    assert (probe.decode_attention_gb_s, probe.decode_attention_gflops) == (3.3, 46.0)
    assert probe.decode_attention_kernel == "cpu_mla" and probe.amx is False
    accelerator = host_accelerator(probe)
    assert "reference CPU MLA decode kernel at 3.3 GB/s" in accelerator.sources[0]
    decode = kernel_rates(accelerator, "bf16").rate("mla_decode")
    assert decode.memory_efficiency == pytest.approx(3.3 / 27.0, abs=1e-3) and decode.measured


def test_vllms_reference_mla_decode_kernel_is_timed_where_vllm_is_installed() -> None:
    """The kernel vLLM's reference CPU MLA backend decodes with, called as it calls it, at small shapes."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM's CPU build is not installed (the Python 3.10 stage)")
    decode = host.vllm_reference_decode_attention(sequences=2, positions=40, heads=(4, 16), threads=1)
    assert decode is not None and decode.cache_gb_s > 0 and decode.gflops > 0
