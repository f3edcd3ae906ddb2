from __future__ import annotations

import json

import pytest

from deepserve.cli.main import main
from deepserve.gateway.keys import KeyRing, KeyStore


def test_keys_create_list_revoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "team-a", "--rpm", "60", "--models", "m1,m2"]) == 0
    secret = capsys.readouterr().out.strip()
    assert secret.startswith("dsk-")
    key = KeyRing(KeyStore()).verify(secret)
    assert key is not None and key.limits.rpm == 60 and key.models == frozenset({"m1", "m2"})

    assert main(["keys", "list"]) == 0
    listing = capsys.readouterr().out
    assert "team-a" in listing and secret not in listing

    assert main(["keys", "revoke", "team-a"]) == 0
    assert KeyRing(KeyStore()).verify(secret) is None
    assert main(["keys", "revoke", "team-a"]) == 2
    assert "no active key named 'team-a'" in capsys.readouterr().err


def test_usage_on_an_empty_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_gateway_without_upstream_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway"]) == 2
    assert "--upstream" in capsys.readouterr().err


def test_gateway_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--upstream", "http://127.0.0.1:1/v1", "--balancing", "fastest"]) == 2
    assert "least_outstanding" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "0"])
def test_keys_create_refuses_a_limit_below_one(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "team", "--rpm", value]) == 2
    error = capsys.readouterr().err
    assert f"--rpm {value} is not a limit" in error and "leave --rpm out for no limit" in error
    assert KeyStore().all_keys() == []  # nothing half-created


def test_gateway_refuses_a_limit_table_too_small_to_use(capsys: pytest.CaptureFixture[str]) -> None:
    upstream = ["--upstream", "http://127.0.0.1:1/v1"]
    assert main(["gateway", *upstream, "--workers", "2", "--limit-zone-keys", "3"]) == 2
    error = capsys.readouterr().err
    assert "gateway.limit_zone_keys" in error and "greater than or equal to 16" in error


def test_gateway_refuses_an_unknown_scorer_and_a_bad_redis_url(capsys: pytest.CaptureFixture[str]) -> None:
    upstream = ["--upstream", "http://127.0.0.1:1/v1"]
    assert main(["gateway", *upstream, "--balancing", "engine_aware", "--score-weight", "latency=2"]) == 2
    assert "prefix" in capsys.readouterr().err  # the valid scorer names are listed
    assert main(["gateway", *upstream, "--redis-url", "http://127.0.0.1:6379"]) == 2
    assert "redis://" in capsys.readouterr().err
