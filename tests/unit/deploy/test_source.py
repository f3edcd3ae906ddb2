"""What every target renders from: the engine config loaded like serve's (no --master-addr needed for several
nodes), a plan's layout (--gpu/--gpus), the model as the nodes load it, the checkpoint's size, and command lines with
node 0's address as a shell variable."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deepserve.deploy.config import DeployConfig
from deepserve.deploy.source import (
    MASTER_PLACEHOLDER,
    deploy_spec,
    load_engine_config,
    planned_config,
    render_model,
    shell_line,
)
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig
from deepserve.hardware.network import NetworkConfig
from deepserve.models.presets import preset_spec
from deepserve.plan.formats import checkpoint_format
from deepserve.plan.memory import checkpoint_bytes

V3 = "deepseek-ai/DeepSeek-V3"


def test_several_nodes_need_no_master_address_to_render(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_engine_config(None, {"model": V3, "nnodes": 2, "pipeline_parallel_size": 2})
    assert config.master_addr == MASTER_PLACEHOLDER
    assert load_engine_config(None, {"model": V3}).master_addr is None
    given = load_engine_config(None, {"model": V3, "nnodes": 2, "master_addr": "10.0.0.1"})
    assert given.master_addr == "10.0.0.1"
    file = tmp_path / "deepserve.yaml"
    file.write_text("engine:\n  max_model_len: 8000\n  master_addr: 10.0.0.2\n  nnodes: 2\n")
    monkeypatch.setenv("DEEPSERVE_ENGINE__MAX_NUM_SEQS", "64")
    loaded = load_engine_config(file, {"model": V3})
    assert (loaded.max_model_len, loaded.max_num_seqs, loaded.master_addr) == (8000, 64, "10.0.0.2")


def test_a_plan_lays_16_h100s_out_as_two_nodes_of_tp8_pp2() -> None:
    config, plan = planned_config(EngineConfig(model=V3), "h100", 16)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.nnodes) == (8, 2, 2)
    assert config.master_addr == MASTER_PLACEHOLDER
    assert plan.fits and plan.deployment.nodes == 2
    assert config.max_model_len == plan.deployment.memory.max_model_len
    spec = deploy_spec(config, GatewayConfig(), "x", plan=plan)
    assert spec.notes[-1].startswith("planned on 16 x h100-sxm (fp8 weights, KV cache bfloat16, network ib): the KV ")


def test_flags_given_with_a_plan_win_over_it() -> None:
    given = EngineConfig.model_validate({"model": V3, "max_model_len": 16384, "max_num_seqs": 64})
    config, plan = planned_config(given, "h200", 8)
    assert (config.max_model_len, config.max_num_seqs, config.nnodes) == (16384, 64, 1)
    assert plan.deployment.memory.max_model_len == 16384  # and the plan was made for them


def test_nnodes_given_with_a_plan_is_the_plan_s_node_count() -> None:
    config, plan = planned_config(EngineConfig(model=V3, nnodes=4, master_addr="10.0.0.1"), "h100", 16)
    assert plan.deployment.nodes == 4
    assert (config.nnodes, config.world_size // config.nnodes) == (4, 4)  # each node's share is on that node


def test_a_plan_that_does_not_fit_is_refused_with_its_numbers() -> None:
    with pytest.raises(ConfigError, match=r"does not fit on 8 x h100-sxm.*fits on 16 x h100"):
        planned_config(EngineConfig(model=V3), "h100", 8)


def test_the_model_as_the_nodes_load_it(tmp_path: Path) -> None:
    assert render_model(EngineConfig(model="v3")).source == V3  # a preset's alias, resolved
    assert render_model(EngineConfig(model="/models/dsv3/", served_model_name="v3")).served_name == "v3"
    assert render_model(EngineConfig(model="/models/dsv3/")).source == "/models/dsv3"  # not looked up here
    with pytest.raises(ConfigError, match="tiny model"):
        render_model(EngineConfig(model="tiny"))
    with pytest.raises(ConfigError, match="--model"):
        render_model(EngineConfig())


def test_deploy_spec_refuses_what_a_gpu_cluster_cannot_run() -> None:
    gateway = GatewayConfig()
    with pytest.raises(ConfigError, match="--device cpu"):
        deploy_spec(EngineConfig(model=V3, device="cpu"), gateway, "x")
    with pytest.raises(ConfigError, match="Ray"):
        deploy_spec(EngineConfig(model=V3, distributed_executor_backend="ray"), gateway, "x")
    with pytest.raises(ValueError, match="DNS label"):
        DeployConfig(name="Deep_Serve")
    with pytest.raises(ConfigError, match="needs 16 GPUs per node"):
        deploy_spec(EngineConfig(model=V3, tensor_parallel_size=16, gpus_per_node=8), gateway, "x")
    with pytest.raises(ConfigError, match="needs 16 GPUs per node over 1 node.*but each node has 8"):
        deploy_spec(EngineConfig(model=V3, tensor_parallel_size=16, gpu_type="h100"), gateway, "x")  # an 8-GPU node
    spec = deploy_spec(EngineConfig(model=V3, tensor_parallel_size=4, gpus_per_node=8), gateway, "x")
    assert spec.notes[0] == "the layout uses 4 of the 8 GPUs on each node"
    with pytest.raises(ValueError, match="'gpu' must look like KEY=VALUE"):
        DeployConfig(node_selector=["gpu"])
    labelled = deploy_spec(EngineConfig(model=V3), gateway, "x", DeployConfig(node_selector=["pool=h100", "zone=a=b"]))
    assert labelled.node_selector == {"pool": "h100", "zone": "a=b"}
    with pytest.raises(ConfigError, match="--prefill-replicas"):
        deploy_spec(EngineConfig(model=V3, role="prefill", kv_connector="NixlConnector"), gateway, "x")
    with pytest.raises(ValueError, match="--max-replicas 1 is below --replicas 2"):
        DeployConfig(replicas=2, max_replicas=1)


def test_the_fit_is_checked_whenever_the_gpu_type_is_known() -> None:
    """Without --gpu/--gpus: refused by the memory plan serve checks on the nodes; noted when it cannot be checked."""
    gateway = GatewayConfig()
    with pytest.raises(ConfigError, match="the memory plan says this cannot run: .* on 8 x h100-sxm"):
        deploy_spec(EngineConfig(model=V3, tensor_parallel_size=8, gpu_type="h100"), gateway, "x")
    fits = deploy_spec(EngineConfig(model=V3, tensor_parallel_size=8, gpu_type="h200"), gateway, "x")
    assert fits.notes[-1].startswith("memory plan: deepseek-ai/DeepSeek-V3 (fp8) on 8 x h200, TP=8: fits")
    unknown = deploy_spec(EngineConfig(model=V3, tensor_parallel_size=8), gateway, "x")
    assert unknown.notes[-1].startswith("memory fit not checked: give --gpu-type")


def test_a_weight_format_the_checkpoint_does_not_have_is_refused() -> None:
    with pytest.raises(ConfigError, match="stored in fp8 .*--weights awq-int4 would plan for weights the engine never"):
        planned_config(EngineConfig(model=V3), "h200", 8, weights="awq-int4")
    with pytest.raises(ConfigError, match="name --model cognitivecomputations/DeepSeek-V3-AWQ \\(its export in awq"):
        planned_config(EngineConfig(model=V3), "h200", 8, weights="awq-int4")
    with pytest.raises(ConfigError, match="or name a checkpoint in awq-int4 with --model$"):
        planned_config(EngineConfig(model="deepseek-ai/DeepSeek-V3.2"), "h200", 8, weights="awq-int4")
    _, plan = planned_config(EngineConfig(model=V3), "h200", 8, weights="fp8")
    assert plan.deployment.fmt.name == "fp8"


def test_the_plan_takes_the_kv_dtype_the_lengths_and_the_network(tmp_path: Path) -> None:
    file = tmp_path / "deepserve.yaml"
    file.write_text("plan:\n  input_len: 4000\n  output_len: 1000\n")
    config, plan = planned_config(
        EngineConfig(model=V3, kv_cache_dtype="fp8"), "h100", 16, file=file, network=NetworkConfig(network="tcp")
    )
    assert (plan.config.input_len, plan.config.output_len, plan.deployment.kv_dtype) == (4000, 1000, "fp8")
    assert plan.deployment.network.name == "tcp"
    assert config.max_num_seqs == plan.deployment.max_num_seqs_per_rank


def test_wide_expert_parallelism_renders_through_the_plan() -> None:
    given = EngineConfig.model_validate(
        {"model": V3, "tensor_parallel_size": 1, "data_parallel_size": 16, "enable_expert_parallel": True}
    )
    config, plan = planned_config(given, "h100", 16)
    assert (config.pipeline_parallel_size, config.data_parallel_size, config.nnodes) == (1, 16, 2)
    assert config.max_num_seqs == plan.deployment.running_cap // 16


def test_checkpoint_size_matches_the_published_one() -> None:
    """DeepSeek-V3's FP8 release: 671B main + 14B MTP parameters, "around 685GB" (seed 001)."""
    spec = preset_spec(V3)
    size = checkpoint_bytes(spec, checkpoint_format(spec))
    assert 670e9 < size < 700e9


def test_shell_line_puts_a_variable_where_the_placeholder_was(tmp_path: Path) -> None:
    argv = ["run", "--dist-init-addr", f"{MASTER_PLACEHOLDER}:5000", "--json", '{"a": "$HOME"}', "it's"]
    line = shell_line(argv, {MASTER_PLACEHOLDER: "LEADER"}, env={"X": "1 2"})
    assert '"${LEADER}":5000' in line
    printer = tmp_path / "run"
    printer.write_text('#!/bin/sh\nprintf "%s|" "$X" "$@"\n')
    printer.chmod(0o755)
    out = subprocess.run(
        ["sh", "-c", line.replace("run", str(printer), 1)],
        env={"LEADER": "10.0.0.1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == '1 2|--dist-init-addr|10.0.0.1:5000|--json|{"a": "$HOME"}|it\'s|'


def test_an_nvl72_rack_launches_on_its_compute_trays() -> None:
    """A GB200 NVL72 rack is one NVLink domain (the plan's node) of 18 machines with 4 GPUs each: the engine runs
    on as many nodes as trays its GPUs fill, each asking for 4 GPUs."""
    layout = EngineConfig(model=V3, tensor_parallel_size=1, data_parallel_size=72, enable_expert_parallel=True)
    config, plan = planned_config(layout, "gb200", 72)
    assert plan.deployment.nodes == 1 and plan.deployment.hosts == 18  # one NVLink domain, eighteen machines
    assert config.nnodes == 18 and config.master_addr == MASTER_PLACEHOLDER
    spec = deploy_spec(config, GatewayConfig(), "x", plan=plan)
    assert spec.nodes == 18 and spec.node_gpus == 4
    assert any(note.startswith("the 18 nodes are compute trays of one gb200 NVLink domain") for note in spec.notes)
    single = deploy_spec(EngineConfig(model=V3, tensor_parallel_size=8, gpu_type="h200"), GatewayConfig(), "x")
    assert not any("NVLink domain" in note for note in single.notes)
    tp8, plan = planned_config(EngineConfig(model=V3), "gb200", 8)
    assert (tp8.nnodes, plan.deployment.hosts) == (2, 2)
    _, plan = planned_config(EngineConfig(model=V3), "h100", 16)
    assert (plan.deployment.nodes, plan.deployment.hosts) == (2, 2)


def test_trays_given_as_nodes_stay_one_nvlink_domain() -> None:
    """--nnodes counts machines: 48 GPUs on 12 trays of an NVL72 rack are planned as one NVLink domain, so the
    experts' all-to-all runs over NVLink, not over the network between machines."""
    layout = EngineConfig(model=V3, tensor_parallel_size=1, data_parallel_size=48, enable_expert_parallel=True)
    config, plan = planned_config(layout.model_copy(update={"nnodes": 12}), "gb200", 48)
    assert (plan.deployment.nodes, plan.deployment.hosts, config.nnodes) == (1, 12, 12)
    links = plan.deployment.performance_model().links
    assert links.experts.kind == "nvlink5" and links.expert_nodes == 1
