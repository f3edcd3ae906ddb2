"""One engine config, several nodes: what each node runs, and the layouts refused before anything starts."""

from __future__ import annotations

from typing import Any

import pytest

from deepserve.config import changed_flags, load_section
from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.topology import check_layout_fits_nodes, check_master_address
from deepserve.errors import ConfigError
from deepserve.models.resolve import ResolvedModel

GPU_MODEL = ResolvedModel("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3", on_cpu=False)
CPU_MODEL = ResolvedModel("/models/tiny", "deepserve/tiny-deepseek-v3", on_cpu=True)
TWO_NODES_PP: dict[str, Any] = {
    "tensor_parallel_size": 8,
    "pipeline_parallel_size": 2,
    "nnodes": 2,
    "master_addr": "10.0.0.1",
}


def argv_of(model: ResolvedModel = GPU_MODEL, python: str | None = None, **fields: object) -> list[str]:
    return get_engine("vllm").launch_spec(EngineConfig.model_validate(fields), model, python).argv


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_printed_command_is_vllm_serve_as_users_type_it() -> None:
    assert argv_of()[:3] == ["vllm", "serve", GPU_MODEL.source]
    assert argv_of(CPU_MODEL, "/venv/bin/python")[:4] == [
        "/venv/bin/python",
        "-m",
        "deepserve.engines.vllm_cli",
        "serve",
    ]


def test_pipeline_across_nodes_head_serves_the_api_and_workers_run_headless() -> None:
    head = argv_of(**TWO_NODES_PP)
    worker = argv_of(**TWO_NODES_PP, node_rank=1)
    for argv, rank in ((head, "0"), (worker, "1")):
        assert value(argv, "--nnodes") == "2"
        assert value(argv, "--node-rank") == rank
        assert value(argv, "--master-addr") == "10.0.0.1"
        assert value(argv, "--master-port") == "29501"
        assert value(argv, "--tensor-parallel-size") == "8"
        assert value(argv, "--pipeline-parallel-size") == "2"
    assert "--headless" not in head and "--port" in head
    assert "--headless" in worker and "--port" not in worker and "--host" not in worker


def test_a_worker_has_no_url_to_be_ready_at() -> None:
    spec = get_engine("vllm").launch_spec(EngineConfig(**TWO_NODES_PP, node_rank=1), GPU_MODEL, None)
    assert spec.base_url == "" and spec.ready_path == ""


def test_whole_replicas_per_node_use_vllms_data_parallel_flags() -> None:
    fields: dict[str, Any] = {
        "data_parallel_size": 4,
        "enable_expert_parallel": True,
        "nnodes": 2,
        "master_addr": "10.0.0.1",
    }
    head = argv_of(**fields, data_parallel_rpc_port=13345)
    worker = argv_of(**fields, node_rank=1, data_parallel_rpc_port=13345)
    for argv in (head, worker):
        assert value(argv, "--data-parallel-size") == "4"
        assert value(argv, "--data-parallel-size-local") == "2"
        assert value(argv, "--data-parallel-address") == "10.0.0.1"
        assert value(argv, "--data-parallel-rpc-port") == "13345"
        assert "--nnodes" not in argv
    assert "--data-parallel-start-rank" not in head
    assert value(worker, "--data-parallel-start-rank") == "2" and "--headless" in worker


def test_nodes_sharing_one_host_on_cpu_split_memory_and_cores() -> None:
    loopback = {"pipeline_parallel_size": 2, "nnodes": 2, "master_addr": "127.0.0.1"}
    engine = get_engine("vllm")
    head = engine.launch_spec(EngineConfig(**loopback), CPU_MODEL, "python")
    worker = engine.launch_spec(EngineConfig(**loopback, node_rank=1), CPU_MODEL, "python")
    assert value(head.argv, "--gpu-memory-utilization") == "0.4"  # each node checks its share against free RAM
    assert head.env["VLLM_CPU_OMP_THREADS_BIND"] != worker.env["VLLM_CPU_OMP_THREADS_BIND"]
    remote = engine.launch_spec(EngineConfig(**{**loopback, "master_addr": "10.0.0.1"}), CPU_MODEL, "python")
    assert "--gpu-memory-utilization" not in remote.argv and remote.env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_sglang_nodes_share_one_dist_init_address() -> None:
    config = EngineConfig(engine="sglang", **TWO_NODES_PP, node_rank=1)
    spec = get_engine("sglang").launch_spec(config, GPU_MODEL, None)
    assert value(spec.argv, "--nnodes") == "2" and value(spec.argv, "--node-rank") == "1"
    assert value(spec.argv, "--dist-init-addr") == "10.0.0.1:29501"
    assert spec.base_url == ""


def test_node_rank_and_master_address_are_checked_with_the_config() -> None:
    with pytest.raises(ConfigError, match="--node-rank 2 is out of range for --nnodes 2"):
        load_section(EngineConfig, "engine", None, {"nnodes": 2, "node_rank": 2, "master_addr": "h"})
    with pytest.raises(ConfigError, match="needs --master-addr"):
        load_section(EngineConfig, "engine", None, {"nnodes": 2})


@pytest.mark.parametrize(
    ("fields", "gpus_per_node", "message"),
    [
        ({"tensor_parallel_size": 3, "nnodes": 2}, 8, "does not split evenly over --nnodes 2"),
        ({"tensor_parallel_size": 16}, 8, "needs 16 GPUs per node over 1 node"),
        ({"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "nnodes": 2}, 4, "each node has 4"),
    ],
)
def test_layouts_the_nodes_cannot_hold_are_refused(fields: dict, gpus_per_node: int, message: str) -> None:
    config = EngineConfig(**fields, master_addr="10.0.0.1" if fields.get("nnodes") else None)
    with pytest.raises(ConfigError, match=message):
        check_layout_fits_nodes(config, gpus_per_node)


def test_a_layout_leaving_gpus_idle_gets_a_note_and_cpu_is_not_counted() -> None:
    assert check_layout_fits_nodes(EngineConfig(tensor_parallel_size=4), 8) == [
        "the layout uses 4 of the 8 GPUs on each node"
    ]
    assert check_layout_fits_nodes(EngineConfig(**TWO_NODES_PP), None) == []


def test_master_address_must_resolve_and_belong_to_node_zero() -> None:
    with pytest.raises(ConfigError, match="does not resolve"):
        check_master_address(EngineConfig(nnodes=2, master_addr="no-such-host.invalid"))
    with pytest.raises(ConfigError, match="is not an address of this machine"):
        check_master_address(EngineConfig(nnodes=2, master_addr="198.51.100.7"))  # TEST-NET-2
    check_master_address(EngineConfig(nnodes=2, master_addr="127.0.0.1"))
    check_master_address(EngineConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1"))


def test_changed_flags_reproduce_a_config() -> None:
    config = EngineConfig(**TWO_NODES_PP, node_rank=1, enable_prefix_caching=False)
    assert changed_flags(config) == [
        "--tensor-parallel-size",
        "8",
        "--pipeline-parallel-size",
        "2",
        "--no-enable-prefix-caching",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
    ]
