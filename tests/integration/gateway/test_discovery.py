"""Replicas discovered from a DNS name (issue 21, point 3): a name that resolves to several simulators on loopback
(127.0.0.x, one port, as a Kubernetes headless Service lists its pods), one replica added and one removed during a
run (its streams in flight finish), per-replica health and metrics; once through a resolver the test controls, once
through a real DNS server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.message
import dns.rdatatype
import dns.rrset
import httpx

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.server import running_gateway
from deepserve.net import free_port
from deepserve.simulate.fixed import fixed_timing
from deepserve.simulate.server import SimulatorServer, running_simulator
from tests.helpers import FAKE_MODEL, until

from .conftest import gateway_config

NAME = "engine.test"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


class Zone:
    """What the DNS name resolves to now: the test changes it during the run."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.fail = False

    async def resolve(self, host: str, port: int) -> list[str]:
        if self.fail or host != NAME:
            raise OSError(f"cannot resolve {host}")
        return list(self.addresses)


@contextlib.asynccontextmanager
async def replicas_on_one_port(itl_ms: float = 0.0) -> AsyncIterator[tuple[int, dict[str, SimulatorServer]]]:
    """A simulator on each of ADDRESSES, all on one port (a pod's port behind a headless Service)."""
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for address in ADDRESSES:
            deployment, config = fixed_timing(0.0, itl_ms, engine={"max_model_len": 4096})
            servers[address] = await stack.enter_async_context(running_simulator(deployment, config, address, port))
        yield port, servers


def _requests(server: SimulatorServer) -> int:
    return server.app.stats.requests


def _replicas(app: GatewayApp) -> set[str]:
    return {replica.url for replica in app.pool.replicas}


def _url(address: str, port: int) -> str:
    return f"http://{address}:{port}/v1"


async def test_replicas_follow_the_name_with_one_added_and_one_removed_during_a_run() -> None:
    zone = Zone(ADDRESSES[0], ADDRESSES[1])
    async with replicas_on_one_port(itl_ms=20) as (port, servers):
        config = gateway_config(f"http://{NAME}:{port}/v1", discover_upstreams=True, balancing="round_robin")
        app = GatewayApp(config, resolve=zone.resolve)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert _replicas(app) == {_url(address, port) for address in ADDRESSES[:2]}
            assert all(replica.healthy for replica in app.pool.replicas)
            long = {**CHAT, "max_tokens": 150, "stream": True}  # 3 s of tokens each: still running after discover()

            async def stream() -> bytes:
                async with client.stream("POST", "/chat/completions", json=long) as response:
                    return b"".join([chunk async for chunk in response.aiter_raw()])

            in_flight = [asyncio.create_task(stream()) for _ in range(4)]
            await until(lambda: _requests(servers[ADDRESSES[0]]) == 2 and _requests(servers[ADDRESSES[1]]) == 2)
            zone.addresses = [ADDRESSES[1], ADDRESSES[2]]  # the first pod goes, a third one comes
            await app.pool.discover()
            assert _replicas(app) == {_url(address, port) for address in ADDRESSES[1:]}
            metrics = app.metrics.render().decode()
            removed = f'replica="{_url(ADDRESSES[0], port)}"'
            assert f"deepserve_gateway_upstream_healthy{{{removed}}} 0.0" in metrics  # draining, still shown
            assert f"deepserve_gateway_upstream_in_flight{{{removed}}} 2.0" in metrics
            for answer in await asyncio.gather(*in_flight):  # the removed replica's streams finished whole
                assert answer.endswith(b"data: [DONE]\n\n") and answer.count(b'"content":') == 151
            before = _requests(servers[ADDRESSES[0]])
            for _ in range(6):
                assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
            assert _requests(servers[ADDRESSES[0]]) == before  # nothing new for the removed one
            assert _requests(servers[ADDRESSES[2]]) == 3  # the added one takes its share at once
            await until(lambda: not app.pool.draining)  # dropped once its requests ended (the health loop)
            assert _url(ADDRESSES[0], port) not in app.metrics.render().decode()


async def test_a_failed_resolution_keeps_the_replicas_found_before() -> None:
    zone = Zone(*ADDRESSES[:2])
    async with replicas_on_one_port() as (port, _):
        config = gateway_config(f"http://{NAME}:{port}/v1", discover_upstreams=True)
        app = GatewayApp(config, resolve=zone.resolve)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
            zone.fail = True
            await app.pool.discover()
            assert len(app.pool.replicas) == 2
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 200


async def test_a_request_never_meets_a_pool_between_its_old_and_new_replicas() -> None:
    """Every address replaced at once (a rollout): the new replicas are checked before the old ones leave, so the
    pool is never without a healthy replica (a request in that window was answered 503)."""
    zone = Zone(ADDRESSES[0])
    async with replicas_on_one_port() as (port, _):
        config = gateway_config(f"http://{NAME}:{port}/v1", discover_upstreams=True, discovery_interval_s=60)
        app = GatewayApp(config, resolve=zone.resolve)
        async with running_gateway(config, app):
            zone.addresses = [ADDRESSES[1], ADDRESSES[2]]
            discovery = asyncio.create_task(app.pool.discover())
            while not discovery.done():
                assert app.pool.ready() and app.pool.models, _replicas(app)
                await asyncio.sleep(0)
            await discovery
            assert _replicas(app) == {_url(address, port) for address in ADDRESSES[1:]}
            assert all(replica.healthy for replica in app.pool.replicas)


# ---- through a real DNS server on loopback ------------------------------------------------------------------------


@contextlib.contextmanager
def dns_server(zone: Zone) -> Iterator[int]:
    """A UDP DNS server on 127.0.0.1 answering A queries for NAME with ZONE's addresses (dnspython's wire format);
    yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, client = sock.recvfrom(4096)
            except TimeoutError:
                continue
            query = dns.message.from_wire(data)
            answer = dns.message.make_response(query)
            question = query.question[0]
            if question.name.to_text().rstrip(".") == NAME and question.rdtype == dns.rdatatype.A:
                answer.answer.append(dns.rrset.from_text(question.name, 1, "IN", "A", *zone.addresses))
            sock.sendto(answer.to_wire(), client)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def dns_resolver(port: int) -> Any:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = port
    resolver.lifetime = 2.0

    async def resolve(host: str, _port: int) -> list[str]:
        try:
            answer = await resolver.resolve(host, "A")
        except dns.exception.DNSException as exc:
            raise OSError(str(exc)) from exc
        return sorted(record.to_text() for record in answer)

    return resolve


async def test_replicas_come_and_go_with_a_real_dns_servers_answers() -> None:
    zone = Zone(*ADDRESSES[:2])
    async with replicas_on_one_port() as (port, servers):
        with dns_server(zone) as dns_port:
            config = gateway_config(f"http://{NAME}:{port}/v1", discover_upstreams=True, discovery_interval_s=0.2)
            app = GatewayApp(config, resolve=dns_resolver(dns_port))
            async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
                assert _replicas(app) == {_url(address, port) for address in ADDRESSES[:2]}
                zone.addresses = [ADDRESSES[2]]  # the discovery loop sees it within its interval
                # healthy too: on a starved machine the new replica's first check can time out (then the next one)
                await until(lambda: _replicas(app) == {_url(ADDRESSES[2], port)} and app.pool.ready())
                assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
                assert _requests(servers[ADDRESSES[2]]) == 1
