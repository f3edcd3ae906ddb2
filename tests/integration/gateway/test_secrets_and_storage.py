"""The gateway as Kubernetes runs it (issue 21, points 3 and 4): keys from a mounted Secret reloaded without a
restart, the ledger on a path of its own (a persistent volume), and an API key sent to engines that require one."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from deepserve.cli.main import main
from deepserve.gateway.app import GatewayApp
from deepserve.gateway.keys import KeyFile, KeyRing, KeyStore
from deepserve.gateway.limits import KeyLimits
from deepserve.gateway.server import running_gateway
from tests.helpers import FAKE_MODEL

from .conftest import gateway_config, upstream

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


class MountedSecret:
    """A directory laid out as the kubelet mounts a Secret: the file is a symlink through `..data`, a symlink to a
    timestamped directory that an update replaces whole (a new directory, then the `..data` link swapped)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name
        self.versions = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.root / self.name

    def update(self, content: bytes) -> None:
        self.versions += 1
        version = self.root / f"..2026_11_26_{self.versions}"
        version.mkdir()
        (version / self.name).write_bytes(content)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to(f"..data/{self.name}")


def _headers(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_keys_from_a_mounted_secret_are_reloaded_without_a_restart(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "admin" / "keys.sqlite")
    _, first = store.create("first", KeyLimits(rpm=100))
    secret = MountedSecret(tmp_path / "secret", "keys.json")
    exported = tmp_path / "export.json"
    store.export(exported)
    secret.update(exported.read_bytes())
    async with upstream() as served:
        config = gateway_config(served.base_url, require_keys=True, keys_file=secret.path)
        app = GatewayApp(config)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/chat/completions", json=CHAT, headers=_headers(first))).status_code == 200
            _, second = store.create("second")
            store.revoke("first")
            store.export(exported)
            secret.update(exported.read_bytes())  # what `kubectl apply` of the Secret does, a moment later
            await app.refresh_keys()  # what the gateway does every second
            assert (await client.post("/chat/completions", json=CHAT, headers=_headers(first))).status_code == 401
            assert (await client.post("/chat/completions", json=CHAT, headers=_headers(second))).status_code == 200
            secret.update(b"{not json")  # a broken update: the keys read before stay
            await app.refresh_keys()
            assert (await client.post("/chat/completions", json=CHAT, headers=_headers(second))).status_code == 200
    store.close()


def test_keys_export_writes_hashes_only_and_the_gateway_reads_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "create", "team", "--rpm", "5", "--models", "m1,m2"]) == 0
    secret = capsys.readouterr().out.strip()
    output = tmp_path / "keys.json"
    assert main(["keys", "export", "--output", str(output)]) == 0
    text = output.read_text()
    assert secret.split("-")[-1] not in text  # the secret itself is never written
    ring = KeyRing(KeyFile(output))
    key = ring.verify(secret)
    assert key is not None and key.name == "team" and key.limits.rpm == 5 and key.models == {"m1", "m2"}


async def test_the_ledger_goes_where_ledger_path_says(tmp_path: Path) -> None:
    ledger_file = tmp_path / "volume" / "usage.sqlite"
    async with upstream() as served:
        config = gateway_config(served.base_url, ledger_path=ledger_file)
        app = GatewayApp(config)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
            assert app.ledger is not None and app.ledger.flush()
    assert main(["usage", "--ledger", str(ledger_file), "--json"]) == 0
    assert ledger_file.stat().st_mode & 0o777 == 0o600


async def test_engines_that_require_an_api_key_get_it_and_a_rotated_key_is_used_without_a_restart(
    tmp_path: Path,
) -> None:
    secret = MountedSecret(tmp_path / "engine-key", "api-key")
    secret.update(b"old-engine-key\n")
    async with upstream(api_key="new-engine-key") as served:
        config = gateway_config(served.base_url, upstream_api_key_file=secret.path)
        app = GatewayApp(config)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
            refused = await client.post("/chat/completions", json=CHAT)
            assert refused.status_code == 503  # the engine refused the old key: no replica serves the model
            secret.update(b"new-engine-key\n")  # the Secret rotated
            app.pool.key.refresh()  # what the health loop does every check
            await app.pool.check_all()
            response = await client.post("/chat/completions", json=CHAT, headers=_headers("dsk-client-key"))
            assert response.status_code == 200  # the engine's key went upstream, never the client's
