"""Shared by the deploy tests: the deployments every target is rendered for (one node, two nodes pipeline parallel,
two nodes of data-parallel replicas, SGLang over two nodes), validators for core Kubernetes objects
(kubernetes-validate, offline schemas) and for custom resources (their CRDs' OpenAPI schemas, kept as fixtures), and a
fake program that records the command line it was started with."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deepserve.deploy.config import DeployConfig
from deepserve.deploy.source import MASTER_PLACEHOLDER, DeploySpec, deploy_spec
from deepserve.engines.config import EngineConfig
from deepserve.gateway.config import GatewayConfig
from deepserve.hardware.network import NetworkConfig

CRDS = Path(__file__).parents[2] / "fixtures" / "crds"
KUBERNETES_VERSION = "1.37.0"  # the newest schemas kubernetes-validate ships
CORE_GROUPS = ("v1", "apps/v1", "autoscaling/v2", "batch/v1", "policy/v1", "networking.k8s.io/v1")

MODEL = "deepseek-ai/DeepSeek-V3-0324"
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "one-node": {"model": MODEL, "tensor_parallel_size": 8, "max_model_len": 32768},
    "two-nodes-pp": {
        "model": MODEL,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "nnodes": 2,
        "master_addr": MASTER_PLACEHOLDER,
    },
    "two-nodes-dp": {
        "model": MODEL,
        "data_parallel_size": 16,
        "enable_expert_parallel": True,
        "nnodes": 2,
        "master_addr": MASTER_PLACEHOLDER,
        "data_parallel_rpc_port": 13345,
    },
    "two-nodes-sglang": {
        "engine": "sglang",
        "model": MODEL,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "nnodes": 2,
        "master_addr": MASTER_PLACEHOLDER,
    },
}


def make_spec(name: str, **extra: Any) -> DeploySpec:
    """DEPLOYMENTS[NAME] with engine FIELDS, a GATEWAY, a PLAN, NETWORK settings (a dict of NetworkConfig fields)
    and any DeployConfig field (replicas=2, name=…) as keyword arguments."""
    fields = {**DEPLOYMENTS[name], **extra.pop("fields", {})}
    gateway = extra.pop("gateway", GatewayConfig())
    plan = extra.pop("plan", None)
    network = NetworkConfig.model_validate(extra.pop("network", {}))
    return deploy_spec(
        EngineConfig.model_validate(fields),
        gateway,
        command=f"deepserve deploy render --test {name}",
        deploy=DeployConfig.model_validate(extra),
        plan=plan,
        network=network,
    )


@pytest.fixture(params=list(DEPLOYMENTS))
def spec(request: pytest.FixtureRequest) -> DeploySpec:
    return make_spec(request.param)


# ---- validators -------------------------------------------------------------------------------------------------


def validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as the API server's strict field validation does (a structural schema would prune
    them silently), except where the CRD preserves unknown fields."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for item in schema:
            _strict(item)
    return schema


def validate_custom(obj: dict[str, Any]) -> None:
    schema = _crd_schemas().get((obj["apiVersion"], obj["kind"]))
    assert schema is not None, f"no CRD fixture for {obj['apiVersion']} {obj['kind']}"
    # OpenAPI v3 schemas are JSON Schema draft 4 plus extensions; the CRDs' patterns are Go regexes (RE2), which
    # Python's re only compiles where it agrees, so the schema itself is not checked against the meta-schema.
    jsonschema.Draft4Validator(schema).validate(obj)


def validate_object(obj: dict[str, Any]) -> None:
    if obj["apiVersion"] in CORE_GROUPS:
        validate_core(obj)
    else:
        validate_custom(obj)


# ---- a program that records how it was started ----------------------------------------------------------------


RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD_TO"], "a") as out:
    out.write(json.dumps({{"program": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                          "node": os.environ.get("SLURM_NODEID")}}) + "\\n")
"""


def fake_programs(directory: Path, *names: str) -> Path:
    """Programs NAMES in DIRECTORY that append their arguments to $RECORD_TO as JSON lines."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        program = directory / name
        program.write_text(RECORDER.format(python=sys.executable))
        program.chmod(0o755)
    return directory


def run_recorded(command: list[str], bin_dir: Path, record: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    done = subprocess.run(
        command,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD_TO": str(record), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


# ---- as fixtures (test modules cannot import conftest) ---------------------------------------------------------


@pytest.fixture
def make() -> Any:
    return make_spec


@pytest.fixture
def validate() -> Any:
    return validate_object


class Recorder:
    """Fake programs on PATH that record their command lines; `run` returns what they recorded."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.record = root / "record.jsonl"

    def programs(self, *names: str) -> Recorder:
        fake_programs(self.bin, *names)
        return self

    def script(self, name: str, text: str) -> Recorder:
        """A fake program with its own behaviour (a shell script)."""
        self.bin.mkdir(parents=True, exist_ok=True)
        path = self.bin / name
        path.write_text("#!/bin/sh\n" + text)
        path.chmod(0o755)
        return self

    def run(self, command: list[str], **env: str) -> list[dict[str, Any]]:
        self.record.unlink(missing_ok=True)
        return run_recorded(command, self.bin, self.record, env)


@pytest.fixture
def recorder(tmp_path: Path) -> Recorder:
    return Recorder(tmp_path / "recorder")
