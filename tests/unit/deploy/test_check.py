"""`deepserve deploy check`: each check with facts made by hand (GPUs, driver, disk, /dev/shm, ports, interfaces,
token), and one real run on this machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from deepserve.cli.main import main
from deepserve.deploy.check import (
    GIB,
    Check,
    Expected,
    HcaPort,
    HostFacts,
    Verdict,
    check_disk,
    check_driver,
    check_gpu_memory,
    check_gpus,
    check_interfaces,
    check_master,
    check_model_access,
    check_rccl,
    check_rdma,
    check_rocm,
    check_rocm_devices,
    check_shm,
    failed,
    gather_facts,
    hca_ports,
    hca_selects,
    run_checks,
)
from deepserve.deploy.netif import Interface
from deepserve.engines.config import EngineConfig
from deepserve.hardware.detect import LocalGpu, local_gpus
from deepserve.hardware.network import NetworkConfig

H100 = LocalGpu(0, "NVIDIA H100 80GB HBM3", 81559)
H200 = LocalGpu(0, "NVIDIA H200", 143771)
A100 = LocalGpu(0, "NVIDIA A100-SXM4-80GB", 81920)
LOOPBACK = Interface("lo", ("127.0.0.1", "::1"), True)
ETH0 = Interface("eth0", ("10.0.0.5",), True)
IB0 = Interface("ib0", ("192.168.50.5",), True)
DOCKER0 = Interface("docker0", ("172.17.0.1",), False)


def facts(tmp_path: Path, **changes: Any) -> HostFacts:
    base = HostFacts(
        gpus=tuple(dataclasses.replace(H100, index=i) for i in range(8)),
        driver_version="570.86.15",
        shm_bytes=64 * GIB,
        interfaces=(LOOPBACK, ETH0),
        environ={},
        free_bytes=lambda path: 2000 * GIB,
        connect=lambda host, port: "refused",
        home=tmp_path / "home",
    )
    return dataclasses.replace(base, **changes)


def expected(gpu: str | None = None, **fields: Any) -> Expected:
    """The deployment as its serve flags give it; GPU is its --gpu-type (what it was planned for)."""
    if gpu:
        fields["gpu_type"] = gpu
    return Expected(EngineConfig.model_validate(fields))


V3: dict[str, Any] = {"model": "deepseek-ai/DeepSeek-V3", "tensor_parallel_size": 8}


def verdict(check: Check) -> Verdict:
    return check.verdict


# ---- GPUs -------------------------------------------------------------------------------------------------------


def test_gpus_not_applicable_on_a_cpu_machine_unless_the_deployment_wants_them(tmp_path: Path) -> None:
    none = facts(tmp_path, gpus=())
    assert verdict(check_gpus(expected(), none)) is Verdict.NA
    needed = check_gpus(expected(device="cuda", tensor_parallel_size=8), none)
    assert needed.verdict is Verdict.FAIL and "needs 8 GPU(s)" in needed.detail and needed.fix


def test_gpus_count_and_type_against_the_plan(tmp_path: Path) -> None:
    eight = facts(tmp_path)
    assert check_gpus(expected("h100", **V3), eight).verdict is Verdict.OK
    assert "8 x NVIDIA H100 80GB HBM3" in check_gpus(expected("h100", **V3), eight).detail
    four = facts(tmp_path, gpus=eight.gpus[:4])
    short = check_gpus(expected("h100", **V3), four)
    assert short.verdict is Verdict.FAIL and "needs 8 on each node" in short.detail
    wrong = check_gpus(expected("h200", **V3), eight)
    assert wrong.verdict is Verdict.FAIL and "h200" in wrong.detail
    two_nodes = expected("h100", **V3, pipeline_parallel_size=2, nnodes=2, master_addr="10.0.0.1")
    assert check_gpus(two_nodes, eight).verdict is Verdict.OK  # 16 GPUs over 2 nodes: 8 here
    idle = check_gpus(expected(tensor_parallel_size=4), eight)
    assert idle.verdict is Verdict.OK and "the layout uses 4" in idle.detail
    mixed = check_gpus(expected(), facts(tmp_path, gpus=(H100, dataclasses.replace(A100, index=1))))
    assert mixed.verdict is Verdict.WARN


def test_gpu_memory_uses_the_planners_numbers(tmp_path: Path) -> None:
    """FP8 DeepSeek-V3 (685 GB) does not fit on 8 x 80 GB; it does on 8 x H200 (seed 002's setup)."""
    h100 = check_gpu_memory(expected(**V3), facts(tmp_path))
    assert h100.verdict is Verdict.FAIL and "does not fit: weights" in h100.detail and h100.fix
    h200 = facts(tmp_path, gpus=tuple(dataclasses.replace(H200, index=i) for i in range(8)))
    fits = check_gpu_memory(expected(**V3), h200)
    assert fits.verdict is Verdict.OK and "x h200" in fits.detail and "KV cache" in fits.detail
    assert check_gpu_memory(expected(), facts(tmp_path, gpus=())).verdict is Verdict.NA
    unknown = facts(tmp_path, gpus=(LocalGpu(0, "Some Future GPU", 1000),))
    assert check_gpu_memory(expected(**V3), unknown).verdict is Verdict.NA


@pytest.mark.parametrize(
    ("version", "wanted"),
    [("470.223.02", Verdict.FAIL), ("525.60.13", Verdict.WARN), ("550.54.15", Verdict.WARN), ("570.86.15", Verdict.OK)],
)
def test_driver_version(version: str, wanted: Verdict, tmp_path: Path) -> None:
    check = check_driver(expected(**V3), facts(tmp_path, driver_version=version))
    assert check.verdict is wanted and version in check.detail
    assert check.verdict is Verdict.OK or check.fix


def test_driver_missing_or_not_needed(tmp_path: Path) -> None:
    assert check_driver(expected(**V3), facts(tmp_path, driver_version=None)).verdict is Verdict.FAIL
    assert check_driver(expected(), facts(tmp_path, gpus=(), driver_version=None)).verdict is Verdict.NA


# ---- disk, /dev/shm ---------------------------------------------------------------------------------------------


def test_disk_for_a_hub_model_compares_free_space_with_the_checkpoint(tmp_path: Path) -> None:
    small = check_disk(expected(**V3), facts(tmp_path, free_bytes=lambda path: 200 * GIB))
    assert small.verdict is Verdict.FAIL and "about 638 GiB" in small.detail and "HF_HOME" in small.fix
    roomy = check_disk(expected(**V3), facts(tmp_path, free_bytes=lambda path: 1000 * GIB))
    assert roomy.verdict is Verdict.OK
    awq = check_disk(expected(model="cognitivecomputations/DeepSeek-V3-AWQ"), facts(tmp_path))
    assert "about 3" in awq.detail  # AWQ's 4-bit checkpoint: about a third of a TB


def test_disk_is_ok_when_the_model_is_cached_and_na_for_local_dirs(tmp_path: Path) -> None:
    cache = tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / "abc"
    cache.mkdir(parents=True)
    (cache / "model-00001-of-00163.safetensors").write_bytes(b"")
    cached = facts(tmp_path, environ={"HF_HOME": str(tmp_path / "hf")}, free_bytes=lambda path: 0)
    assert check_disk(expected(**V3), cached).verdict is Verdict.OK
    assert check_disk(expected(model=str(tmp_path)), facts(tmp_path)).verdict is Verdict.NA
    assert check_disk(expected(), facts(tmp_path)).verdict is Verdict.NA  # the tiny model


def test_disk_of_an_unknown_hub_model_is_a_warning(tmp_path: Path) -> None:
    check = check_disk(expected(model="someone/SomeModel"), facts(tmp_path))
    assert check.verdict is Verdict.WARN and "size is unknown" in check.detail


def test_shm_too_small_fails_for_several_gpu_workers(tmp_path: Path) -> None:
    docker_default = 64 * 1024**2
    fails = check_shm(expected(**V3), facts(tmp_path, shm_bytes=docker_default))
    assert fails.verdict is Verdict.FAIL and "--ipc=host" in fails.fix
    assert check_shm(expected(), facts(tmp_path, shm_bytes=docker_default)).verdict is Verdict.WARN
    assert check_shm(expected(**V3), facts(tmp_path, shm_bytes=16 * GIB)).verdict is Verdict.OK
    assert check_shm(expected(**V3), facts(tmp_path, shm_bytes=None)).verdict is Verdict.FAIL


# ---- node 0's address, interfaces -------------------------------------------------------------------------------


def two_nodes(rank: int, master: str = "127.0.0.1") -> Expected:
    return expected(**V3, pipeline_parallel_size=2, nnodes=2, node_rank=rank, master_addr=master)


def test_master_not_applicable_on_one_node(tmp_path: Path) -> None:
    assert check_master(expected(**V3), facts(tmp_path)).verdict is Verdict.NA
    ray = check_master(expected(**V3, distributed_executor_backend="ray"), facts(tmp_path))
    assert ray.verdict is Verdict.NA and "cluster status" in ray.detail


def test_worker_reaches_node_zero_or_says_what_blocks_it(tmp_path: Path) -> None:
    asked: list[tuple[str, int]] = []

    def answer(how: str) -> Any:
        def connect(host: str, port: int) -> str:
            asked.append((host, port))
            return how

        return connect

    assert check_master(two_nodes(1), facts(tmp_path, connect=answer("open"))).verdict is Verdict.OK
    assert asked == [("127.0.0.1", 29501), ("127.0.0.1", 29601)]  # the master port and deepserve's join port
    waiting = check_master(two_nodes(1), facts(tmp_path, connect=answer("refused")))
    assert waiting.verdict is Verdict.WARN and "start node 0 first" in waiting.fix
    blocked = check_master(two_nodes(1), facts(tmp_path, connect=answer("timeout")))
    assert blocked.verdict is Verdict.FAIL and "29501" in blocked.fix and "timeout" in blocked.detail


def test_node_zero_owns_the_address_and_its_ports_are_free(tmp_path: Path) -> None:
    assert check_master(two_nodes(0), facts(tmp_path, connect=lambda h, p: "refused")).verdict is Verdict.OK
    busy = check_master(two_nodes(0), facts(tmp_path, connect=lambda h, p: "open"))
    assert busy.verdict is Verdict.FAIL and "already listens" in busy.detail
    elsewhere = check_master(two_nodes(0, master="203.0.113.9"), facts(tmp_path))  # TEST-NET-3: never ours
    assert elsewhere.verdict is Verdict.FAIL and "not an address of this machine" in elsewhere.detail
    assert elsewhere.fix.startswith("run node 0 on that machine") and elsewhere.fix not in elsewhere.detail
    nowhere = check_master(two_nodes(1, master="no-such-host.invalid"), facts(tmp_path))
    assert nowhere.verdict is Verdict.FAIL and "does not resolve" in nowhere.detail
    assert nowhere.fix.startswith("give node 0's IP address") and "does not resolve" not in nowhere.fix


def test_several_interfaces_without_the_socket_variables_warn_with_the_fix(tmp_path: Path) -> None:
    several = facts(tmp_path, interfaces=(LOOPBACK, ETH0, IB0, DOCKER0))
    check = check_interfaces(two_nodes(0, master="127.0.0.1"), several)
    assert check.verdict is Verdict.WARN and "eth0, ib0" in check.detail  # docker0 is down, lo is loopback
    assert "NCCL_SOCKET_IFNAME=lo" in check.fix and "GLOO_SOCKET_IFNAME=lo" in check.fix  # holds node 0's address
    set_both = dataclasses.replace(several, environ={"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "=eth0"})
    assert check_interfaces(two_nodes(1), set_both).verdict is Verdict.OK
    excluded = dataclasses.replace(several, environ={"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth"})
    assert check_interfaces(two_nodes(1), excluded).verdict is Verdict.OK


def test_a_socket_variable_naming_no_interface_fails(tmp_path: Path) -> None:
    wrong = facts(tmp_path, interfaces=(LOOPBACK, ETH0), environ={"NCCL_SOCKET_IFNAME": "ib9"})
    check = check_interfaces(two_nodes(1), wrong)
    assert check.verdict is Verdict.FAIL and "NCCL_SOCKET_IFNAME=ib9" in check.detail


def test_interfaces_not_applicable_on_one_node_and_fine_with_one_interface(tmp_path: Path) -> None:
    assert check_interfaces(expected(**V3), facts(tmp_path)).verdict is Verdict.NA
    assert check_interfaces(two_nodes(1), facts(tmp_path)).verdict is Verdict.OK


# ---- the model --------------------------------------------------------------------------------------------------


def test_hub_model_needs_a_token_or_says_what_a_missing_one_means(tmp_path: Path) -> None:
    assert check_model_access(expected(**V3), facts(tmp_path, environ={"HF_TOKEN": "hf_x"})).verdict is Verdict.OK
    token_file = tmp_path / "home" / ".cache" / "huggingface" / "token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text("hf_x")
    in_file = check_model_access(expected(**V3), facts(tmp_path))
    assert in_file.verdict is Verdict.OK and str(token_file) in in_file.detail
    token_file.unlink()
    missing = check_model_access(expected(**V3), facts(tmp_path))
    assert missing.verdict is Verdict.WARN and "HF_TOKEN" in missing.fix


def test_local_model_must_be_readable(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert check_model_access(expected(model=str(model)), facts(tmp_path)).verdict is Verdict.FAIL
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert check_model_access(expected(model=str(model)), facts(tmp_path)).verdict is Verdict.OK
    assert check_model_access(expected(), facts(tmp_path)).verdict is Verdict.NA


# ---- RDMA (the network profile's HCAs) ---------------------------------------------------------------------------

TWO_NODES = {**V3, "pipeline_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1"}
IB_PORTS = (HcaPort("mlx5_0", 1, "ACTIVE", "InfiniBand"), HcaPort("mlx5_1", 1, "ACTIVE", "InfiniBand"))


def rdma(tmp_path: Path, network: dict[str, Any], **changes: Any) -> Check:
    profile = NetworkConfig.model_validate(network).profile()
    ready = {"hca_ports": IB_PORTS, "verbs_devices": True, "memlock_bytes": None, **changes}
    return check_rdma(Expected(EngineConfig.model_validate(TWO_NODES), profile), facts(tmp_path, **ready))


def test_rdma_passes_with_the_profiles_hcas_active(tmp_path: Path) -> None:
    ok = rdma(tmp_path, {"network": "ib", "ib_hca": "=mlx5_1"})
    assert ok.verdict is Verdict.OK and ok.detail.startswith("mlx5_1:1 active")


def test_rdma_fails_without_the_named_hcas(tmp_path: Path) -> None:
    none = rdma(tmp_path, {"network": "ib"}, hca_ports=())
    assert none.verdict is Verdict.FAIL and "no RDMA adapter" in none.detail and "--network tcp" in none.fix
    named = rdma(tmp_path, {"network": "ib", "ib_hca": "=mlx5_7"})
    assert named.verdict is Verdict.FAIL and "NCCL_IB_HCA==mlx5_7 selects none" in named.detail


def test_rdma_fails_on_ports_down_or_of_the_wrong_link_layer(tmp_path: Path) -> None:
    down = rdma(tmp_path, {"network": "ib"}, hca_ports=(HcaPort("mlx5_0", 1, "DOWN", "InfiniBand"),))
    assert down.verdict is Verdict.FAIL and "ACTIVE" in down.detail
    roce = rdma(tmp_path, {"network": "roce"})  # the ports are InfiniBand
    assert roce.verdict is Verdict.FAIL and "--network ib" in roce.fix


def test_rdma_fails_without_verbs_devices_and_warns_on_a_memlock_limit(tmp_path: Path) -> None:
    hidden = rdma(tmp_path, {"network": "ib"}, verbs_devices=False)
    assert hidden.verdict is Verdict.FAIL and "/dev/infiniband" in hidden.fix
    locked = rdma(tmp_path, {"network": "ib"}, memlock_bytes=64 * 1024)
    assert locked.verdict is Verdict.WARN and "memlock=-1" in locked.fix


def test_rdma_not_applicable_on_sockets_or_one_node(tmp_path: Path) -> None:
    assert rdma(tmp_path, {"network": "tcp"}).verdict is Verdict.NA
    one = check_rdma(Expected(EngineConfig.model_validate(V3)), facts(tmp_path))
    assert one.verdict is Verdict.NA


def test_nccl_ib_hca_syntax() -> None:
    port = HcaPort("mlx5_10", 1, "ACTIVE", "InfiniBand")
    assert hca_selects(None, port) and hca_selects("mlx5", port) and hca_selects("mlx5_1", port)  # prefixes
    assert not hca_selects("=mlx5_1", port) and hca_selects("=mlx5_10:1", port)
    assert not hca_selects("=mlx5_10:2", port) and not hca_selects("^mlx5", port)


def test_hca_ports_are_read_from_sysfs(tmp_path: Path) -> None:
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    assert hca_ports(tmp_path) == (HcaPort("mlx5_0", 1, "ACTIVE", "Ethernet"),)
    assert hca_ports(tmp_path / "none") == ()


# ---- all together -----------------------------------------------------------------------------------------------


def test_a_node_ready_for_the_plan_fails_nothing(tmp_path: Path) -> None:
    h200 = facts(tmp_path, gpus=tuple(dataclasses.replace(H200, index=i) for i in range(8)), environ={"HF_TOKEN": "x"})
    checks = run_checks(expected("h200", **V3), h200)
    assert not failed(checks)
    assert {check.name for check in checks} == {
        "GPUs",
        "GPU memory",
        "NVIDIA driver",
        "ROCm",
        "ROCm devices",
        "RCCL environment",
        "disk for the weights",
        "/dev/shm",
        "node 0's address and ports",
        "NCCL/Gloo interface",
        "RDMA (network profile)",
        "model access",
    }
    assert failed([*checks, Check("x", Verdict.FAIL, "broken", "fix it")])


def test_real_run_on_this_machine_reports_what_does_not_apply() -> None:
    checks = run_checks(expected(), gather_facts())
    by_name = {check.name: check for check in checks}
    if not local_gpus():
        for name in ("GPUs", "GPU memory", "NVIDIA driver", "ROCm", "ROCm devices", "RCCL environment"):
            assert by_name[name].verdict is Verdict.NA, by_name[name]
    assert by_name["node 0's address and ports"].verdict is Verdict.NA
    assert by_name["/dev/shm"].verdict in (Verdict.OK, Verdict.WARN)
    assert all(check.verdict is Verdict.OK or check.verdict is Verdict.NA or check.fix for check in checks)


def test_cli_exits_non_zero_when_a_check_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "check"]) == (1 if failed(run_checks(expected(), gather_facts())) else 0)
    out = capsys.readouterr().out
    assert "/dev/shm" in out and "node 0 of 1" in out
    wants_gpus = ["deploy", "check", "--model", "deepseek-ai/DeepSeek-V3", "--device", "cuda", "--json"]
    if not local_gpus():
        assert main(wants_gpus) == 1
        assert '"verdict": "fail"' in capsys.readouterr().out


# ---- AMD Instinct nodes ---------------------------------------------------------------------------------------------

MI300X = LocalGpu(0, "AMD Instinct MI300X", 196592, "amd", "gfx942")
MI355X = LocalGpu(0, "AMD Instinct MI355X", 294896, "amd", "gfx950")
RENDER = {f"/dev/dri/renderD{128 + 8 * i}": "ok" for i in range(8)}


def amd_facts(tmp_path: Path, gpu: LocalGpu = MI300X, **changes: Any) -> HostFacts:
    base = facts(
        tmp_path,
        gpus=tuple(dataclasses.replace(gpu, index=i) for i in range(8)),
        driver_version=None,
        rocm_version="7.0.2",
        device_files={"/dev/kfd": "ok", **RENDER},
    )
    return dataclasses.replace(base, **changes)


def test_an_amd_node_ready_for_the_plan_fails_nothing(tmp_path: Path) -> None:
    node = amd_facts(tmp_path, environ={"HF_TOKEN": "x"})
    checks = {check.name: check for check in run_checks(expected("mi300x", **V3), node)}
    assert not failed(list(checks.values()))
    assert checks["GPUs"].verdict is Verdict.OK and "AMD Instinct MI300X" in checks["GPUs"].detail
    assert checks["GPU memory"].verdict is Verdict.OK
    assert checks["NVIDIA driver"].verdict is Verdict.NA
    assert checks["ROCm"].verdict is Verdict.OK and checks["ROCm devices"].verdict is Verdict.OK
    assert checks["RCCL environment"].verdict is Verdict.OK


def test_the_rocm_checks_do_not_apply_to_nvidia_nodes(tmp_path: Path) -> None:
    for check in (check_rocm, check_rocm_devices, check_rccl):
        assert check(expected("h100", **V3), facts(tmp_path)).verdict is Verdict.NA


@pytest.mark.parametrize(
    "gpu, version, wanted",
    [
        (MI300X, "6.4.1", Verdict.OK),
        (MI300X, "6.2.4", Verdict.FAIL),
        (MI355X, "6.4.1", Verdict.FAIL),  # gfx950 needs ROCm 7.0
        (MI355X, "7.0.2", Verdict.OK),
        (MI300X, None, Verdict.WARN),  # in vLLM's ROCm image the host needs only the driver
    ],
)
def test_rocm_version(gpu: LocalGpu, version: str | None, wanted: Verdict, tmp_path: Path) -> None:
    check = check_rocm(expected(**V3), amd_facts(tmp_path, gpu, rocm_version=version))
    assert check.verdict is wanted
    assert check.verdict is Verdict.OK or check.fix


def test_rocm_device_files(tmp_path: Path) -> None:
    needs_eight = expected(**V3)
    missing = check_rocm_devices(needs_eight, amd_facts(tmp_path, device_files=RENDER))
    assert (
        missing.verdict is Verdict.FAIL
        and "/dev/kfd is missing" in missing.detail
        and "--device /dev/kfd" in missing.fix
    )
    denied = check_rocm_devices(needs_eight, amd_facts(tmp_path, device_files={"/dev/kfd": "no access", **RENDER}))
    assert denied.verdict is Verdict.FAIL and "video and render groups" in denied.fix
    four = dict(list(RENDER.items())[:4])
    short = check_rocm_devices(needs_eight, amd_facts(tmp_path, device_files={"/dev/kfd": "ok", **four}))
    assert short.verdict is Verdict.FAIL and "4 render node(s)" in short.detail


def test_rccl_environment(tmp_path: Path) -> None:
    hidden = check_rccl(expected(**V3), amd_facts(tmp_path, environ={"HIP_VISIBLE_DEVICES": "0,1,2,3"}))
    assert hidden.verdict is Verdict.FAIL and "HIP_VISIBLE_DEVICES=0,1,2,3" in hidden.detail
    two_nodes = expected(**V3, pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    assert check_rccl(two_nodes, amd_facts(tmp_path)).verdict is Verdict.WARN  # no RDMA NIC: TCP sockets
    ports = tuple(HcaPort(name, 1, "ACTIVE", "Ethernet") for name in ("rdma0", "rdma1"))
    rdma = amd_facts(tmp_path, hca_ports=ports)
    no_gid = check_rccl(two_nodes, rdma)
    assert no_gid.verdict is Verdict.WARN and "NCCL_IB_GID_INDEX=3" in no_gid.fix
    disabled = check_rccl(two_nodes, dataclasses.replace(rdma, environ={"NCCL_IB_DISABLE": "1"}))
    assert disabled.verdict is Verdict.WARN and "will not use them" in disabled.detail
    ready = check_rccl(two_nodes, dataclasses.replace(rdma, environ={"NCCL_IB_GID_INDEX": "3"}))
    assert ready.verdict is Verdict.OK


def test_an_amd_node_without_its_gpus_says_which_tools_looked(tmp_path: Path) -> None:
    check = check_gpus(expected(device="rocm", tensor_parallel_size=8), facts(tmp_path, gpus=()))
    assert check.verdict is Verdict.FAIL and "amd-smi" in check.detail and "ROCm" in check.fix
