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
