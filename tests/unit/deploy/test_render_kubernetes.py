"""Kubernetes manifests for one node (a Deployment) and two nodes (a LeaderWorkerSet): every object valid against its
schema (core objects with kubernetes-validate --strict, custom resources against their CRDs), and every engine
command exactly what the engine's launcher writes for that node, checked by running the pod's command."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import kubernetes
from deepserve.deploy.render import render
from deepserve.deploy.source import KV_SHARED_PATH, MASTER_PLACEHOLDER, DeploySpec
from deepserve.errors import ConfigError

LEADER = "deepserve-engine-0.deepserve-engine.default"


def objects(spec: DeploySpec) -> list[dict[str, Any]]:
    return [obj for documents in kubernetes.render(spec).values() for obj in documents]


def find(spec: DeploySpec, kind: str) -> dict[str, Any]:
    return next(obj for obj in objects(spec) if obj["kind"] == kind)


def engine_object(spec: DeploySpec) -> dict[str, Any]:
    return find(spec, "LeaderWorkerSet" if spec.nodes > 1 else "Deployment")


def named(spec: DeploySpec, kind: str, name: str) -> dict[str, Any]:
    return next(obj for obj in objects(spec) if obj["kind"] == kind and obj["metadata"]["name"] == name)


def gateway_words(spec: DeploySpec) -> list[str]:
    words: list[str] = find(spec, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["command"]
    return words


def values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, word in enumerate(words) if word == flag]


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
        "Job",
        engine_kind,
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Service",
        "Service",
        "StatefulSet",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
        "NetworkPolicy",
        "PodMonitor",
        "PrometheusRule",
        "ConfigMap",
    ]


def test_disaggregated_autoscaled_deployments_are_valid_too(make: Any, validate: Any) -> None:
    for name in ("one-node", "two-nodes-pp"):
        spec = make(name, prefill_replicas=1, replicas=2, max_replicas=4, capacity_per_replica=64, engine_api_key=True)
        for obj in objects(spec):
            validate(obj)
        assert {obj["kind"] for obj in objects(spec)} >= {"ScaledObject", "NetworkPolicy", "PodDisruptionBudget"}


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


def test_pods_get_gpus_cpu_memory_shared_memory_the_model_cache_and_the_token(spec: DeploySpec) -> None:
    for pod in pod_specs(spec):
        container = pod["containers"][0]
        gpus = str(spec.gpus_per_node)
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == gpus
        assert requests["cpu"] == "36" and requests["memory"] == limits["memory"] == "96Gi"  # 8 GPUs
        assert "cpu" not in limits  # Burstable on purpose: no throttled scheduler loop
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        # The memory-backed /dev/shm counts against the memory limit: the limit holds it and the processes.
        assert kubernetes.shm_bytes(8) < kubernetes.engine_memory_bytes(8) - 64 * 2**30
        claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
        assert claim == find(spec, "PersistentVolumeClaim")["metadata"]["name"]
        mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
        assert set(mounts) == {"/dev/shm", "/root/.cache/huggingface", "/var/cache/vllm"}
        assert mounts["/var/cache/vllm"]["subPath"] == "vllm-cache"  # the compile cache outlives the pod
        env = {entry["name"]: entry for entry in container["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "deepserve-hf-token",
            "key": "HF_TOKEN",
            "optional": True,
        }
        assert env["VLLM_CACHE_ROOT"]["value"] == "/var/cache/vllm"


def test_guaranteed_qos_sets_the_cpu_limit(make: Any) -> None:
    resources = pod_specs(make("one-node", qos="guaranteed"))[0]["containers"][0]["resources"]
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"]


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


def test_the_model_cache_holds_the_checkpoint_on_the_storage_class(make: Any) -> None:
    spec = make("one-node", storage_class="lustre")
    claim = find(spec, "PersistentVolumeClaim")
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert spec.checkpoint_bytes is not None
    assert int(size.removesuffix("Gi")) * 2**30 >= spec.checkpoint_bytes * 1.2  # room for a second revision
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "lustre"
    ledger = find(spec, "StatefulSet")["spec"]["volumeClaimTemplates"][0]
    assert ledger["spec"]["storageClassName"] == "lustre"
    assert "storageClassName" not in find(make("one-node"), "PersistentVolumeClaim")["spec"]


def test_a_job_downloads_the_model_once_and_the_engines_wait_for_its_marker(spec: DeploySpec, recorder: Any) -> None:
    job = find(spec, "Job")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    marker = "/root/.cache/huggingface/deepserve-ready/deepseek-ai--DeepSeek-V3-0324"
    assert "snapshot_download" in script and script.rstrip().endswith(f"touch {marker}")
    for pod in pod_specs(spec):
        wait = pod["initContainers"][0]
        assert wait["name"] == "wait-for-model" and f"until [ -f {marker} ]" in wait["command"][2]
        env = {entry["name"]: entry.get("value") for entry in pod["containers"][0]["env"]}
        assert env["HF_HUB_OFFLINE"] == "1"  # no engine pod downloads inside its startup probe
    # The Job's script runs the downloader, then writes the marker.
    recorder.programs("python3")
    root = recorder.bin.parent
    ran = recorder.run(["/bin/sh", "-c", script.replace("/root/.cache/huggingface", str(root))])
    assert ran[0]["program"] == "python3" and ran[0]["argv"][-1] == "deepseek-ai/DeepSeek-V3-0324"
    assert (root / "deepserve-ready" / "deepseek-ai--DeepSeek-V3-0324").exists()


def test_a_model_on_a_path_has_no_download(make: Any) -> None:
    spec = make("one-node", fields={"model": "/models/dsv3"})
    assert all(obj["kind"] != "Job" for obj in objects(spec))
    assert "initContainers" not in pod_specs(spec)[0]


def test_a_deployment_rolls_out_while_serving_within_a_deadline_sized_to_the_start(make: Any) -> None:
    several = engine_object(make("one-node", replicas=3, fields={"startup_timeout_s": 2400}))["spec"]
    assert several["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    spec = make("one-node", fields={"startup_timeout_s": 2400})
    download_s = spec.checkpoint_bytes / kubernetes.DOWNLOAD_BYTES_PER_S  # the first rollout waits for it
    assert several["progressDeadlineSeconds"] >= 2400 + download_s
    on_a_path = engine_object(make("one-node", fields={"startup_timeout_s": 2400, "model": "/models/v3"}))
    assert 2400 <= on_a_path["spec"]["progressDeadlineSeconds"] < 2400 + download_s
    single = engine_object(make("one-node"))["spec"]
    assert single["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}  # never zero replicas


def test_leader_worker_sets_roll_out_group_by_group_and_take_topology_and_queue(make: Any) -> None:
    spec = make("two-nodes-pp", replicas=2, exclusive_topology="nvidia.com/gpu.clique", kueue_queue="gpu-queue",
                scheduler_name="volcano")  # fmt: skip
    lws = engine_object(spec)
    assert lws["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1},
    }
    assert lws["metadata"]["annotations"] == {"leaderworkerset.sigs.k8s.io/exclusive-topology": "nvidia.com/gpu.clique"}
    assert lws["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert all(pod["schedulerName"] == "volcano" for pod in pod_specs(spec))


def test_every_pool_has_a_disruption_budget_and_so_has_the_gateway(make: Any) -> None:
    spec = make("one-node", replicas=2)
    budgets = {obj["metadata"]["name"]: obj["spec"] for obj in objects(spec) if obj["kind"] == "PodDisruptionBudget"}
    assert budgets["deepserve-engine"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": kubernetes.pool_labels(spec, spec.serving_pool)},
    }
    assert budgets["deepserve-gateway"]["maxUnavailable"] == 1


def test_the_startup_probe_waits_as_long_as_the_engine_may_take_and_liveness_is_on_health(make: Any) -> None:
    spec = make("one-node", fields={"startup_timeout_s": 2400})
    container = pod_specs(spec)[0]["containers"][0]
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 2400
    assert startup["failureThreshold"] == math.ceil(2400 / startup["periodSeconds"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_gateway_discovers_every_replica_from_a_headless_service(make: Any) -> None:
    spec = make("two-nodes-pp", replicas=2)
    words = gateway_words(spec)
    assert values(words, "--upstream") == ["http://deepserve-engine-api.$(POD_NAMESPACE).svc.cluster.local:8000/v1"]
    assert "--discover-upstreams" in words
    service = named(spec, "Service", "deepserve-engine-api")["spec"]
    assert service["clusterIP"] == "None"  # its DNS name lists every ready leader, one per replica
    assert service["selector"]["role"] == "leader"
    container = find(spec, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    namespace = next(env for env in container["env"] if env["name"] == "POD_NAMESPACE")
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"  # the kubelet expands $(…)
    assert words[words.index("--host") + 1] == "0.0.0.0"  # keys are required off loopback
    from deepserve.gateway.config import GatewayConfig

    literal = gateway_words(make("one-node", gateway=GatewayConfig(model_alias=["v3=$(HOME)"])))
    assert values(literal, "--model-alias") == ["v3=$$(HOME)"]  # the config's own words are not expanded


def test_the_gateway_reads_keys_from_the_secret_and_keeps_its_ledger_on_a_volume(make: Any) -> None:
    spec = make("one-node")
    gateway = find(spec, "StatefulSet")
    pod = gateway["spec"]["template"]["spec"]
    keys = next(volume for volume in pod["volumes"] if volume["name"] == "keys")
    assert keys["secret"] == {"secretName": "deepserve-gateway-keys", "optional": True}
    mounts = {mount["name"]: mount for mount in pod["containers"][0]["volumeMounts"]}
    assert "subPath" not in mounts["keys"]  # mounted whole, the kubelet updates the file in place
    assert values(gateway_words(spec), "--keys-file") == ["/etc/deepserve/keys/keys.sqlite"]
    assert "initContainers" not in pod  # no copy taken once at start
    assert mounts["state"]["mountPath"] == "/var/lib/deepserve"
    assert gateway["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert find(spec, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"


def test_an_engine_api_key_is_refused_where_the_engine_would_ignore_it(make: Any) -> None:
    with pytest.raises(ConfigError, match="sglang would ignore it"):
        make("two-nodes-sglang", engine_api_key=True)


def test_redis_is_deployed_for_shared_limits_and_only_the_gateway_reaches_it(make: Any) -> None:
    from deepserve.gateway.config import GatewayConfig

    spec = make("one-node")
    assert values(gateway_words(spec), "--redis-url") == ["redis://deepserve-redis:6379/0"]
    redis = named(spec, "StatefulSet", "deepserve-redis")["spec"]
    assert "--appendonly" in redis["template"]["spec"]["containers"][0]["args"]  # revocations survive a restart
    policy = named(spec, "NetworkPolicy", "deepserve-redis")["spec"]
    assert policy["ingress"][0]["from"] == [{"podSelector": {"matchLabels": kubernetes.labels(spec, "gateway")}}]
    external = make("one-node", gateway=GatewayConfig(redis_url="redis://redis.shared:6379/2"))
    assert values(gateway_words(external), "--redis-url") == ["redis://redis.shared:6379/2"]
    assert all(obj["metadata"]["name"] != "deepserve-redis" for obj in objects(external))


def test_engines_answer_only_the_gateway_prometheus_and_each_other(make: Any) -> None:
    spec = make("two-nodes-pp", monitoring_namespace="observability")
    policy = named(spec, "NetworkPolicy", "deepserve-engine")["spec"]
    assert policy["podSelector"]["matchLabels"] == kubernetes.labels(spec, "engine")
    assert policy["policyTypes"] == ["Ingress"]
    gateway, monitoring, engines = policy["ingress"]
    assert gateway == {
        "from": [{"podSelector": {"matchLabels": kubernetes.labels(spec, "gateway")}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    assert monitoring["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "observability"}
    assert engines == {"from": [{"podSelector": {"matchLabels": kubernetes.labels(spec, "engine")}}]}  # every port


def test_an_engine_api_key_from_a_secret_which_the_gateway_sends(make: Any) -> None:
    spec = make("one-node", engine_api_key=True)
    env = {entry["name"]: entry for entry in pod_specs(spec)[0]["containers"][0]["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "deepserve-engine-api-key", "key": "api-key"}
    assert values(gateway_words(spec), "--upstream-api-key-file") == ["/etc/deepserve/engine-api-key/api-key"]
    assert "--upstream-api-key-file" not in gateway_words(make("one-node"))


def test_engines_get_the_network_profile_over_several_nodes(make: Any) -> None:
    spec = make("two-nodes-pp", network={"ib_hca": "=mlx5_0,mlx5_1", "pod_networks": "rdma-net",
                                          "network_env": ["NCCL_IB_TC=106"]})  # fmt: skip
    for pod in pod_specs(spec):
        container = pod["containers"][0]
        env = {entry["name"]: entry.get("value") for entry in container["env"]}
        assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1" and env["NCCL_IB_DISABLE"] == "0"
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["NCCL_IB_TC"] == "106"  # passed through
        assert container["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    leader = engine_object(spec)["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "rdma-net"}
    roce = pod_specs(make("two-nodes-pp", network={"network": "roce"}))[0]["containers"][0]
    assert {e["name"]: e.get("value") for e in roce["env"]}["NCCL_IB_GID_INDEX"] == "3"
    tcp = pod_specs(make("two-nodes-pp", network={"network": "tcp"}))[0]["containers"][0]
    assert {e["name"]: e.get("value") for e in tcp["env"]}["NCCL_IB_DISABLE"] == "1"
    assert "securityContext" not in tcp and "rdma/rdma_shared_device_a" not in tcp["resources"]["requests"]
    single = pod_specs(make("one-node"))[0]["containers"][0]  # no traffic between nodes: nothing to ask for
    assert "securityContext" not in single and "NCCL_IB_HCA" not in {e["name"] for e in single["env"]}


def test_prefill_and_decode_pools_and_the_gateway_routes_prefill_then_decode(make: Any) -> None:
    spec = make("one-node", prefill_replicas=2, replicas=3)
    prefill = named(spec, "Deployment", "deepserve-prefill")
    decode = named(spec, "Deployment", "deepserve-decode")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    for deployment, role in ((prefill, "prefill"), (decode, "decode")):
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert deployment["spec"]["template"]["metadata"]["labels"]["deepserve/pool"] == role
    words = gateway_words(spec)
    assert values(words, "--upstream") == ["http://deepserve-decode-api.$(POD_NAMESPACE).svc.cluster.local:8000/v1"]
    assert values(words, "--prefill-upstream") == [
        "http://deepserve-prefill-api.$(POD_NAMESPACE).svc.cluster.local:8000/v1"
    ]
    assert named(spec, "Service", "deepserve-prefill-api")["spec"]["selector"]["deepserve/pool"] == "prefill"
    # Prefill and decode pods move KV between each other over the nodes' network: they get the profile.
    assert "rdma/rdma_shared_device_a" in prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_a_shared_directory_connector_mounts_one_directory_in_both_pools(make: Any) -> None:
    spec = make("one-node", prefill_replicas=1, fields={"kv_connector": "ExampleConnector"})
    for name in ("deepserve-prefill", "deepserve-decode"):
        container = named(spec, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        transfer = json.loads(container["command"][container["command"].index("--kv-transfer-config") + 1])
        assert transfer["kv_connector_extra_config"] == {"shared_storage_path": KV_SHARED_PATH}
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == KV_SHARED_PATH)
        assert mount["subPath"] == "kv-transfer/deepserve"


def test_keda_scales_the_serving_pool_on_the_engines_load_with_the_plans_capacity(validate: Any) -> None:
    from deepserve.deploy.config import DeployConfig
    from deepserve.deploy.source import deploy_spec, planned_config
    from deepserve.engines.config import EngineConfig
    from deepserve.gateway.config import GatewayConfig

    config, plan = planned_config(EngineConfig(model="deepseek-ai/DeepSeek-V3"), "h200", 8)
    spec = deploy_spec(config, GatewayConfig(), "x", deploy=DeployConfig(replicas=2, max_replicas=6), plan=plan)
    scaled = find(spec, "ScaledObject")
    validate(scaled)
    body = scaled["spec"]
    assert body["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "deepserve-engine"}
    assert (body["minReplicaCount"], body["maxReplicaCount"]) == (2, 6)
    load, kv = body["triggers"]
    capacity = plan.max_concurrency_within_slo or plan.deployment.running_cap
    assert load["metricType"] == "AverageValue" and load["metadata"]["threshold"] == str(capacity)
    assert "vllm:num_requests_waiting{" in load["metadata"]["query"]
    assert 'deepserve_pool="engine"' in load["metadata"]["query"]
    assert "vllm:kv_cache_usage_perc" in kv["metadata"]["query"]
    assert load["metadata"]["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    down = body["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= config.startup_timeout_s  # a replica takes that long to return


def test_keda_targets_a_leader_worker_set_and_needs_a_capacity(make: Any) -> None:
    spec = make("two-nodes-pp", max_replicas=3, capacity_per_replica=48)
    scaled = find(spec, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert scaled["triggers"][0]["metadata"]["threshold"] == "48"
    with pytest.raises(ConfigError, match="--capacity-per-replica"):
        kubernetes.render(make("two-nodes-pp", max_replicas=3))
    assert "autoscaling.yaml" not in kubernetes.render(make("one-node"))


def test_the_keda_schema_check_can_fail(make: Any, validate: Any) -> None:
    scaled = find(make("one-node", max_replicas=3, capacity_per_replica=8), "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # KEDA's trigger metadata holds strings only
    with pytest.raises(Exception, match="8"):
        validate(scaled)


def test_monitoring_scrapes_api_pods_labelled_for_kube_prometheus_stack(make: Any) -> None:
    spec = make("two-nodes-pp")
    monitor = find(spec, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert find(spec, "PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    body = monitor["spec"]
    assert body["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "deepserve"
    endpoint = body["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    targets = [relabel["targetLabel"] for relabel in endpoint["relabelings"]]
    assert targets == ["component", "deepserve_instance", "deepserve_pool"]
    assert endpoint["relabelings"][2]["sourceLabels"] == ["__meta_kubernetes_pod_label_deepserve_pool"]
    dashboard = find(spec, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert '"uid": "deepserve"' in dashboard["data"]["deepserve.json"]
    assert (
        'DCGM_FI_DEV_GPU_UTIL{pod=~\\"deepserve-(engine|prefill|decode)-.*\\"}' in dashboard["data"]["deepserve.json"]
    )
    other = find(make("one-node", prometheus_release="monitoring"), "PodMonitor")
    assert other["metadata"]["labels"]["release"] == "monitoring"


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


def test_the_network_policy_and_budget_schema_checks_can_fail(make: Any, validate: Any) -> None:
    spec = make("one-node")
    policy = named(spec, "NetworkPolicy", "deepserve-engine")
    policy["spec"]["ingres"] = []
    with pytest.raises(Exception, match="ingres"):
        validate(policy)
    budget = named(spec, "PodDisruptionBudget", "deepserve-engine")
    budget["spec"]["maxUnavailable"] = [1]
    with pytest.raises(Exception, match="maxUnavailable"):
        validate(budget)
