from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deepserve.cli.flags import add_section_flags, section_overrides
from deepserve.config import load_section
from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig, gateway_argv


def test_defaults_are_safe() -> None:
    config = GatewayConfig.model_validate({})
    assert config.host == "127.0.0.1" and not config.keys_required()
    assert not config.log_bodies


def test_non_loopback_requires_keys_unless_insecure_open() -> None:
    assert GatewayConfig.model_validate({"host": "0.0.0.0"}).keys_required()
    assert not GatewayConfig.model_validate({"host": "0.0.0.0", "insecure_open": True}).keys_required()
    assert GatewayConfig.model_validate({"require_keys": True}).keys_required()
    assert not GatewayConfig.model_validate({"host": "::1"}).keys_required()


def test_unknown_policy_and_bad_values_fail_fast() -> None:
    with pytest.raises(ConfigError, match="least_outstanding"):
        load_section(GatewayConfig, "gateway", None, {"balancing": "random"})
    with pytest.raises(ConfigError, match="ALIAS=MODEL"):
        load_section(GatewayConfig, "gateway", None, {"model_alias": ["nope"]})
    with pytest.raises(ConfigError, match="http"):
        load_section(GatewayConfig, "gateway", None, {"upstream": ["localhost:8000"]})
    with pytest.raises(ConfigError, match="upstream"):
        GatewayConfig.model_validate({}).check_startable()


def test_environment_feeds_the_section(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_GATEWAY__MAX_QUEUE", "7")
    assert load_section(GatewayConfig, "gateway").max_queue == 7


def test_gateway_argv_round_trips_through_the_cli_flags() -> None:
    config = GatewayConfig.model_validate(
        {
            "upstream": ["http://127.0.0.1:9001/v1", "http://127.0.0.1:9002/v1"],
            "port": 8000,
            "host": "0.0.0.0",
            "require_keys": True,
            "balancing": "prefix_affinity",
            "model_alias": ["fast=m"],
            "queue_timeout_s": 2.5,
            "max_model_len": 2048,
            "prefill_upstream": ["http://engine-prefill.ns.svc.cluster.local:8000/v1"],
            "discover_upstreams": True,
            "discovery_interval_s": 5,
            "keys_file": "/etc/deepserve/keys/keys.json",
            "ledger_path": "/var/lib/deepserve/usage.sqlite",
            "upstream_api_key_file": "/etc/deepserve/engine/api-key",
            "default_chat_template_kwargs": ['deepseek-ai/DeepSeek-V3.1={"thinking": true}'],
        }
    )
    argv = gateway_argv(config, "/usr/bin/python3")
    assert argv[:4] == ["/usr/bin/python3", "-m", "deepserve.cli.main", "gateway"]
    parser = argparse.ArgumentParser()
    add_section_flags(parser, GatewayConfig)
    parsed = load_section(GatewayConfig, "gateway", None, section_overrides(parser.parse_args(argv[4:]), GatewayConfig))
    assert parsed == config


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://:8000/v1", "has no host"),
        ("http:///v1", "has no host"),
        ("http://user:pw@engine:8000/v1", "remove them"),
        ("http://token@engine:8000/v1", "credentials"),
        ("http://engine:80a/v1", "invalid port"),
        ("http://engine:70000/v1", "invalid port"),
        ("http://engine:8000/v1?x=1", "query or fragment"),
        ("http://engine:8000/\u20ac/v1", "percent-encode"),
        ("http://engine:8000/a b/v1", "percent-encode"),
    ],
)
def test_upstream_urls_the_client_cannot_use_fail_fast_with_a_fix(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_section(GatewayConfig, "gateway", None, {"upstream": [url]})


def test_good_upstream_urls_are_accepted() -> None:
    urls = ["http://127.0.0.1:8001/v1", "https://engine.ns.svc/v1/", "http://[::1]:8000/v1", "http://engine"]
    config = load_section(GatewayConfig, "gateway", None, {"upstream": urls})
    assert config.upstream == [url.rstrip("/") for url in urls]


def test_files_the_gateway_reads_must_exist_before_it_starts(tmp_path: Path) -> None:
    for field, flag in (("keys_file", "--keys-file"), ("upstream_api_key_file", "--upstream-api-key-file")):
        config = GatewayConfig.model_validate({"upstream": ["http://127.0.0.1:8001/v1"], field: tmp_path / "absent"})
        with pytest.raises(ConfigError, match=f"{flag} .* is not a readable file"):
            config.check_startable()
