"""Kubernetes manifests for one node (a Deployment) and two nodes (a LeaderWorkerSet): every object valid against its
schema (core objects with kubernetes-validate --strict, custom resources against their CRDs), and every engine
command exactly what the engine's launcher writes for that node, checked by running the pod's command."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import kubernetes
from deepserve.deploy.render import render
from deepserve.deploy.source import MASTER_PLACEHOLDER, DeploySpec

LEADER = "deepserve-engine-0.deepserve-engine.default"


def objects(spec: DeploySpec) -> list[dict[str, Any]]:
    return [obj for documents in kubernetes.render(spec).values() for obj in documents]


def find(spec: DeploySpec, kind: str) -> dict[str, Any]:
    return next(obj for obj in objects(spec) if obj["kind"] == kind)


def engine_object(spec: DeploySpec) -> dict[str, Any]:
    return find(spec, "LeaderWorkerSet" if spec.nodes > 1 else "Deployment")


def pod_specs(spec: DeploySpec) -> list[dict[str, Any]]:
    engine = engine_object(spec)
    if engine["kind"] == "Deployment":
        return [engine["spec"]["template"]["spec"]]
    template = engine["spec"]["leaderWorkerTemplate"]
    return [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]


def test_every_object_is_valid_against_its_schema(spec: DeploySpec, validate: Any) -> None:
    kinds = []
    for obj in objects(spec):
        validate(obj)
        kinds.append(obj["kind"])
    engine_kind = "LeaderWorkerSet" if spec.nodes > 1 else "Deployment"
    assert kinds == [
        "PersistentVolumeClaim",
        engine_kind,
        "Service",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodMonitor",
        "PrometheusRule",
        "ConfigMap",
    ]


def test_the_crd_validation_rejects_what_the_api_server_would(make: Any, validate: Any) -> None:
    """The custom-resource check can fail: an unknown field and a wrong type are refused."""
    lws = engine_object(make("two-nodes-pp"))
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(Exception, match="sizee"):
        validate(lws)
    rule = find(make("one-node"), "PrometheusRule")
    rule["spec"]["groups"][0]["rules"] = "not a list"
    with pytest.raises(Exception, match="not a list"):
        validate(rule)


def test_one_node_runs_the_launchers_command_in_a_deployment(make: Any) -> None:
    spec = make("one-node", replicas=3)
    deployment = engine_object(spec)
    assert deployment["spec"]["replicas"] == 3
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == spec.launch(0).argv
    assert container["command"][:3] == ["vllm", "serve", spec.model.source]
    assert container["image"] == "vllm/vllm-openai:v0.32.0"


@pytest.mark.parametrize("name", ["two-nodes-pp", "two-nodes-dp", "two-nodes-sglang"])
def test_each_pod_of_a_group_runs_its_ranks_command(name: str, make: Any, recorder: Any) -> None:
    """The leader and worker templates' shell scripts, run as LWS runs them (LWS_WORKER_INDEX, LWS_LEADER_ADDRESS),
    start exactly the launcher's command for that rank with the leader's address."""
    spec = make(name)
    engine = engine_object(spec)
    template = engine["spec"]["leaderWorkerTemplate"]
    assert template["size"] == spec.nodes
    program = spec.launch(0).argv[0]
    recorder.programs(program)
    for rank in range(spec.nodes):
        role = "leaderTemplate" if rank == 0 else "workerTemplate"
        command = template[role]["spec"]["containers"][0]["command"]
        assert command[:2] == ["/bin/sh", "-c"]
        ran = recorder.run(command, LWS_WORKER_INDEX=str(rank), LWS_LEADER_ADDRESS=LEADER)
        expected = spec.launch(rank, master_addr=LEADER).argv
        assert ran == [{"program": expected[0], "argv": expected[1:], "node": None}]
        assert MASTER_PLACEHOLDER not in " ".join(command)
    worker = template["workerTemplate"]["spec"]["containers"][0]["command"]
    with pytest.raises(AssertionError):  # a rank the template has no line for fails instead of running something
        recorder.run(worker, LWS_WORKER_INDEX="0", LWS_LEADER_ADDRESS=LEADER)


def test_leader_serves_the_api_and_workers_run_headless(make: Any) -> None:
    spec = make("two-nodes-pp")
    leader, worker = (pod["containers"][0] for pod in pod_specs(spec))
    assert "--headless" not in leader["command"][2] and "--port 8000" in leader["command"][2]
    assert "--headless" in worker["command"][2] and "--port" not in worker["command"][2]
    assert "ports" in leader and "startupProbe" in leader
    assert "ports" not in worker and "startupProbe" not in worker  # no HTTP on a headless node
    lws = engine_object(spec)["spec"]
    assert lws["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["startupPolicy"] == "LeaderCreated"


def test_pods_get_gpus_shared_memory_the_model_cache_and_the_token(spec: DeploySpec) -> None:
    for pod in pod_specs(spec):
        container = pod["containers"][0]
        gpus = str(spec.gpus_per_node)
        assert container["resources"] == {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
        assert claim == find(spec, "PersistentVolumeClaim")["metadata"]["name"]
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        assert mounts == {"dshm": "/dev/shm", "model-cache": "/root/.cache/huggingface"}
        token = next(env for env in container["env"] if env["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "deepserve-hf-token", "key": "HF_TOKEN", "optional": True}


def test_engine_pods_tolerate_gpu_taints_and_take_runtime_class_and_node_selector(make: Any, validate: Any) -> None:
    plain = pod_specs(make("one-node"))[0]
    assert plain["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "runtimeClassName" not in plain and "nodeSelector" not in plain
    spec = make("two-nodes-pp", runtime_class="nvidia", node_selector=["nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"])
    for pod in pod_specs(spec):  # seed 001's setting for its GPU nodes
        assert pod["runtimeClassName"] == "nvidia"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    validate(engine_object(spec))
    with pytest.raises(Exception, match="KEY=VALUE"):
        make("one-node", node_selector=["gpu"])


def test_the_model_cache_holds_the_checkpoint(make: Any) -> None:
    spec = make("one-node")
    size = find(spec, "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"]
    assert spec.checkpoint_bytes is not None
    assert int(size.removesuffix("Gi")) * 2**30 >= spec.checkpoint_bytes * 1.2  # room for a second revision
    assert find(spec, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_startup_probe_waits_as_long_as_the_engine_may_take_to_start(make: Any) -> None:
    spec = make("one-node", fields={"startup_timeout_s": 2400})
    container = pod_specs(spec)[0]["containers"][0]
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 2400
    assert startup["failureThreshold"] == math.ceil(2400 / startup["periodSeconds"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": spec.launch(0).ready_path, "port": "http"}


def test_the_gateway_balances_over_every_replica_and_takes_keys_from_a_secret(make: Any) -> None:
    spec = make("two-nodes-pp", replicas=2)
    pod = find(spec, "Deployment")["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    upstreams = [command[i + 1] for i, word in enumerate(command) if word == "--upstream"]
    assert upstreams == [
        "http://deepserve-engine-0.deepserve-engine:8000/v1",  # LWS's per-group leader names
        "http://deepserve-engine-1.deepserve-engine:8000/v1",
    ]
    assert command[command.index("--host") + 1] == "0.0.0.0"  # keys are required off loopback
    keys = next(volume for volume in pod["volumes"] if volume["name"] == "keys")
    assert keys["secret"] == {"secretName": "deepserve-gateway-keys", "optional": True}
    assert "keys.sqlite" in pod["initContainers"][0]["command"][2]
    autoscaler = find(spec, "HorizontalPodAutoscaler")["spec"]
    assert autoscaler["scaleTargetRef"]["name"] == "deepserve-gateway"
    assert autoscaler["minReplicas"] >= 2


def test_one_node_replicas_sit_behind_the_engine_service(make: Any) -> None:
    spec = make("one-node", replicas=2)
    assert kubernetes.engine_urls(spec) == ["http://deepserve-engine-api:8000/v1"]
    service = next(o for o in objects(spec) if o["kind"] == "Service" and o["metadata"]["name"].endswith("-api"))
    assert service["spec"]["selector"] == kubernetes.labels(spec, "engine")


def test_gateway_limits_come_from_the_gateway_config(make: Any) -> None:
    from deepserve.gateway.config import GatewayConfig

    spec = make("one-node", gateway=GatewayConfig(max_concurrency=64, max_queue=200))
    command = find(spec, "Deployment")
    gateway = next(o for o in objects(spec) if o["kind"] == "Deployment" and "gateway" in o["metadata"]["name"])
    words = gateway["spec"]["template"]["spec"]["containers"][0]["command"]
    assert words[words.index("--max-concurrency") + 1] == "64" and words[words.index("--max-queue") + 1] == "200"
    assert command["metadata"]["name"] == "deepserve-engine"
    rules = find(spec, "PrometheusRule")["spec"]["groups"][0]["rules"]
    queue = next(rule for rule in rules if rule["alert"] == "DeepserveGatewayQueueFilling")
    assert queue["expr"].endswith("> 100")  # half of this gateway's --max-queue


def test_monitoring_scrapes_api_pods_labelled_by_component(make: Any) -> None:
    spec = make("two-nodes-pp")
    monitor = find(spec, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "deepserve"
    endpoint = monitor["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"][0]["targetLabel"] == "component"
    dashboard = find(spec, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert '"uid": "deepserve"' in dashboard["data"]["deepserve.json"]


def test_rendered_files_start_with_how_they_were_made_and_how_to_apply_them(make: Any, tmp_path: Path) -> None:
    spec = make("two-nodes-pp")
    written = render(spec, "kubernetes", tmp_path, "k8s")
    assert sorted(path.name for path in written) == sorted(kubernetes.FILES)
    for path in written:
        text = path.read_text()
        assert text.startswith(f"# Made by deepserve 0.1.0: {spec.command}\n")
        assert "# Deploys deepseek-ai/DeepSeek-V3-0324 on 2 node(s) x 8 GPU(s)" in text
        assert "#   kubectl apply -f k8s/" in text
        assert "lws/releases/download" in text  # the LeaderWorkerSet controller
        documents = list(yaml.safe_load_all(text))
        assert [doc["kind"] for doc in documents] == [obj["kind"] for obj in kubernetes.render(spec)[path.name]]
