"""`deepserve deploy render --target T --out DIR`: the targets by name, and the files each writes, every one headed by
how it was made and how to apply it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from deepserve import __version__
from deepserve.deploy import compose, kubernetes, slurm
from deepserve.deploy.config import check_target_options
from deepserve.deploy.source import DeploySpec
from deepserve.errors import ConfigError, unknown_name


@dataclass(frozen=True)
class RenderedFile:
    path: str  # relative to the output directory
    text: str


class Target(Protocol):
    name: str

    def files(self, spec: DeploySpec, out: str) -> list[RenderedFile]:
        """The files to write under OUT (named in the apply instructions as the user typed it)."""
        ...


def header(spec: DeploySpec, apply: list[str]) -> list[str]:
    return [
        f"Made by deepserve {__version__}: {spec.command}",
        f"Deploys {spec.describe()}.",
        *(f"note: {note}" for note in spec.notes),
        "How to apply:",
        *(f"  {line}" for line in apply),
        "Edit the command above and render again rather than editing this file.",
    ]


def with_header(path: str, text: str, lines: list[str]) -> RenderedFile:
    if path.endswith(".json"):  # JSON has no comments: the header is the object's first member
        data: dict[str, Any] = json.loads(text)
        return RenderedFile(path, json.dumps({"__comment": lines, **data}, indent=2) + "\n")
    comment = "".join(f"# {line}".rstrip() + "\n" for line in lines)
    if text.startswith("#!"):
        shebang, _, rest = text.partition("\n")
        return RenderedFile(path, f"{shebang}\n{comment}{rest}")
    return RenderedFile(path, comment + text)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (shell scripts) as literal blocks, so they read as they run; no anchors and aliases
    for repeated values (plain manifests, as people write them)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(documents: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000) for doc in documents)


class KubernetesTarget:
    name = "kubernetes"

    def files(self, spec: DeploySpec, out: str) -> list[RenderedFile]:
        n = kubernetes.names(spec)
        apply = [
            f"kubectl create secret generic {n['hf_token']} --from-literal=HF_TOKEN=hf_...   (gated models only)",
            f"DEEPSERVE_HOME=./keys deepserve keys create NAME && kubectl create secret generic {n['keys']} "
            "--from-file=keys.sqlite=./keys/gateway/keys.sqlite   (the gateway requires keys; update the Secret to "
            "add or revoke keys, the gateway pods read the new file without a restart)",
            f"docker build -t {spec.gateway_image} <deepserve checkout> and push it where the cluster pulls from "
            "(--gateway-image REGISTRY/deepserve:TAG)",
        ]
        if spec.deploy.engine_api_key:
            apply.append(
                f"kubectl create secret generic {n['engine_key']} --from-literal=api-key=$(openssl rand -hex 32)   "
                "(the engines' API key, which the gateway sends)"
            )
        if spec.nodes > 1:
            apply.append(
                "the LeaderWorkerSet controller: kubectl apply --server-side -f "
                "https://github.com/kubernetes-sigs/lws/releases/download/v0.10.0/manifests.yaml"
            )
        if spec.uses_network and spec.network.rdma:
            apply.append(
                f"RDMA for the engine pods ({spec.network.rdma_resource}): NVIDIA's Network Operator with its RDMA "
                "device plugin (or pass --rdma-resource / --network tcp)"
            )
        if spec.deploy.autoscaled:
            apply.append("autoscaling.yaml needs KEDA (https://keda.sh) and the Prometheus it queries")
        apply += [
            "monitoring.yaml needs the Prometheus Operator (its CRDs), Grafana's dashboard sidecar and, for the GPU "
            "panels, NVIDIA's DCGM exporter",
            f"kubectl apply -f {out}/   (the Job {n['download']} downloads the model once; the engines wait for it)",
            f"kubectl port-forward svc/{n['gateway']} 8000   then   curl http://127.0.0.1:8000/v1/models "
            "-H 'Authorization: Bearer dsk-…'",
        ]
        lines = header(spec, apply)
        return [with_header(path, dump_yaml(objects), lines) for path, objects in kubernetes.render(spec).items()]


class ComposeTarget:
    name = "compose"

    def files(self, spec: DeploySpec, out: str) -> list[RenderedFile]:
        documents = compose.compose_files(spec)
        node0 = "" if spec.nodes == 1 else "on node 0: "
        apply = [
            f"{node0}docker build -t {spec.gateway_image} <deepserve checkout>   (the gateway's image)",
            f"{node0}DEEPSERVE_HOME={out}/deepserve-home deepserve keys create NAME   (the gateway requires keys)",
        ]
        if spec.deploy.engine_api_key:
            apply.append(
                f"{node0}openssl rand -hex 32 > {out}/{compose.ENGINE_KEY_FILE} && echo "
                f'"ENGINE_API_KEY=$(cat {out}/{compose.ENGINE_KEY_FILE})" >> {out}/.env   (the engines\' API key)'
            )
        if spec.nodes == 1:
            apply.append(f"HF_TOKEN=hf_... docker compose -f {out}/docker-compose.yaml up -d   (HF_TOKEN: gated only)")
        else:
            apply = [
                f"copy {out}/ to the same path on every node (compose is per host: each node starts its own file)",
                *apply,
                f"on every node: name the interface that reaches the others in {out}/{compose.NETWORK_ENV}",
                f"on node R: MASTER_ADDR=<node 0's address> docker compose -f {out}/docker-compose.nodeR.yaml up -d",
                "node 0 serves the API (and the gateway); the other nodes run headless",
                f"when a node fails: {out}/{compose.RESTART_SCRIPT} NODE0 NODE1 ... restarts the whole group (a "
                "running rendezvous does not take one node back alone; the engines never restart on their own)",
            ]
        apply.append("Grafana: http://127.0.0.1:3000 on node 0 (dashboard: deepserve); Prometheus: :9090")
        lines = header(spec, apply)
        rendered = [with_header(path, dump_yaml([doc]), lines) for path, doc in documents.items()]
        rendered += [with_header(path, text, lines) for path, text in compose.config_files(spec).items()]
        return rendered


class SlurmTarget:
    name = "slurm"

    def files(self, spec: DeploySpec, out: str) -> list[RenderedFile]:
        slurm.check(spec)
        apply = [
            f"cd {out} && sbatch {slurm.SCRIPT}",
            "keys: node 0's deepserve reads DEEPSERVE_HOME (default ~/.deepserve): `deepserve keys create NAME` there",
            f"the job's log ({spec.name}-<job id>.log) shows each node's progress and node 0's READY line",
        ]
        lines = header(spec, apply)
        rendered = [with_header(slurm.SCRIPT, "#!/bin/bash\n" + slurm.batch_script(spec), lines)]
        gateway = slurm.gateway_file(spec.gateway)
        if gateway:
            rendered.append(with_header(slurm.GATEWAY_CONFIG, gateway, lines))
        return rendered


TARGETS: dict[str, Target] = {t.name: t for t in (KubernetesTarget(), ComposeTarget(), SlurmTarget())}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ConfigError(unknown_name("deploy target", name, list(TARGETS))) from None


def render(spec: DeploySpec, target: str, out: Path, out_as_typed: str | None = None) -> list[Path]:
    """Write TARGET's files for SPEC under OUT; return their paths."""
    chosen = get_target(target)
    check_target_options(spec.deploy, target)
    files = chosen.files(spec, out_as_typed or str(out))
    written = []
    for rendered in files:
        path = out / rendered.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rendered.text)
            if path.suffix in (".sbatch", ".sh"):
                path.chmod(0o755)
        except OSError as exc:
            raise ConfigError(f"cannot write {path} ({exc.strerror}); choose a writable directory with --out") from None
        written.append(path)
    return written
