"""Prefill and decode engines: the typed fields (--role, --kv-connector, --kv-connector-config) become vLLM's
--kv-transfer-config JSON, read back by vLLM's own argument parser into its KVTransferConfig, and SGLang's
--disaggregation-* flags; `serve --role` runs the engine alone (the gateway of both pools routes to it)."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.vllm import KV_CONNECTORS
from deepserve.errors import ConfigError
from deepserve.models.resolve import ResolvedModel
from deepserve.serve import service_plan as service
from deepserve.serve.config import ServeConfig

V3 = "deepseek-ai/DeepSeek-V3"
GPU_MODEL = ResolvedModel(V3, V3, on_cpu=False)


def argv(**fields: Any) -> list[str]:
    return get_engine(fields.get("engine", "vllm")).launch_spec(EngineConfig(**fields), GPU_MODEL, None).argv


def transfer(words: list[str]) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(words[words.index("--kv-transfer-config") + 1])
    return parsed


def needs_vllm() -> None:
    pytest.importorskip("vllm")
    importlib.import_module("deepserve.engines.vllm_cli")  # vLLM's CPU build needs its version answered first


@pytest.fixture(scope="module")
def vllm_serve_parser() -> Any:
    needs_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_roles_name_the_direction_of_the_transfer() -> None:
    config = {"kv_connector": "ExampleConnector", "kv_connector_config": ["shared_storage_path=/mnt/kv"]}
    prefill = transfer(argv(role="prefill", **config))
    assert prefill == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/mnt/kv"},
    }
    assert transfer(argv(role="decode", **config))["kv_role"] == "kv_consumer"
    assert transfer(argv(role="decode", kv_connector="NixlConnector"))["kv_role"] == "kv_both"  # NIXL's peers
    assert "--kv-transfer-config" not in argv()


def test_connector_settings_keep_their_json_types() -> None:
    settings = ["kv_lease_duration=45", "shared_storage_path=/kv", "flag=true"]
    extra = transfer(argv(role="prefill", kv_connector="NixlConnector", kv_connector_config=settings))
    assert extra["kv_connector_extra_config"] == {"kv_lease_duration": 45, "shared_storage_path": "/kv", "flag": True}


def test_vllms_parser_reads_the_rendered_json_as_its_kv_transfer_config(vllm_serve_parser: Any) -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    for role, expected in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        words = argv(role=role, kv_connector="ExampleConnector", kv_connector_config=["shared_storage_path=/kv"])
        assert words[:2] == ["vllm", "serve"]
        args = vllm_serve_parser.parse_args(words[2:])
        config = args.kv_transfer_config
        assert isinstance(config, KVTransferConfig)
        assert (config.kv_connector, config.kv_role) == ("ExampleConnector", expected)
        assert config.kv_connector_extra_config == {"shared_storage_path": "/kv"}
        assert config.is_kv_producer == (role == "prefill")


def test_our_connector_names_are_the_installed_vllms() -> None:
    needs_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert sorted(KV_CONNECTORS) == sorted(KVConnectorFactory._registry)


def test_bad_connector_settings_fail_with_the_fix() -> None:
    with pytest.raises(ValueError, match="needs --kv-connector"):
        EngineConfig(role="prefill")
    with pytest.raises(ConfigError, match="valid: .*NixlConnector"):
        argv(role="prefill", kv_connector="P2pNcclConnector")  # gone from vLLM 0.32
    with pytest.raises(ValueError, match="KEY=VALUE"):
        EngineConfig(role="prefill", kv_connector="NixlConnector", kv_connector_config=["/mnt/kv"])


def test_sglang_takes_the_role_and_its_transfer_backend() -> None:
    words = argv(engine="sglang", role="decode", kv_connector="NixlConnector")
    assert words[words.index("--disaggregation-mode") + 1] == "decode"
    assert words[words.index("--disaggregation-transfer-backend") + 1] == "nixl"
    with pytest.raises(ConfigError, match="MooncakeConnector"):
        argv(engine="sglang", role="decode", kv_connector="ExampleConnector")


def test_serve_with_a_role_runs_the_engine_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    config = EngineConfig(role="prefill", kv_connector="ExampleConnector", port=8100)
    plan = service.plan_service(config, ServeConfig())
    assert plan.gateway is None
    assert plan.public.base_url == "http://127.0.0.1:8100/v1"
    assert any("--prefill-upstream http://127.0.0.1:8100/v1" in note for note in plan.notes)
    assert transfer(plan.launch.argv)["kv_role"] == "kv_producer"
