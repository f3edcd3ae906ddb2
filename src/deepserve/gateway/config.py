"""The `gateway` section of the config tree. CLI flags of `deepserve gateway` are derived from these fields."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from deepserve.config import Section, changed_flags, deepserve_home
from deepserve.engines.base import url_host
from deepserve.errors import ConfigError, unknown_name
from deepserve.gateway.balancing import DEFAULT_SCORE_WEIGHTS, POLICIES
from deepserve.gateway.resp import RedisAddress
from deepserve.gateway.scheduling import MAX_SLICE_US, MIN_SLICE_US

BALANCING_POLICIES = tuple(POLICIES)
# The slice the gateway asks for: the shortest Linux grants (docs/PERFORMANCE.md, "A short scheduler slice").
DEFAULT_SLICE_US = MIN_SLICE_US


class GatewayConfig(Section):
    """The OpenAI-compatible front door: where it listens, where it forwards, and how it protects the engine."""

    upstream: list[str] = Field(
        default_factory=list,
        description="engine base URL, e.g. http://127.0.0.1:8001/v1; repeat for replicas (with --prefill-upstream: "
        "the decode replicas)",
    )
    prefill_upstream: list[str] = Field(
        default_factory=list,
        description="prefill engine base URL (vLLM's KV-transfer prefill role); repeat for replicas. Each "
        "completion and chat request is prefilled there (max_tokens 1, kv_transfer_params do_remote_decode) and "
        "decoded on an --upstream replica with the prefill's kv_transfer_params",
    )
    discover_upstreams: bool = Field(
        False,
        description="treat each upstream (and prefill upstream) host name as a DNS name with one address per replica "
        "(a Kubernetes headless Service): re-resolved every --discovery-interval-s, replicas added and removed as "
        "addresses come and go (a removed one finishes its requests in flight)",
    )
    discovery_interval_s: float = Field(10.0, gt=0, description="seconds between resolutions of the upstream names")
    upstream_api_key_file: Path | None = Field(
        None,
        description="file holding the API key the engines require (vLLM's --api-key), sent upstream as "
        "`Authorization: Bearer`; re-read when it changes (a mounted Kubernetes Secret)",
    )
    keys_file: Path | None = Field(
        None,
        description="read API keys from this file (`deepserve keys export`: hashes only, e.g. a mounted Kubernetes "
        "Secret) instead of the key database; re-read within a second of a change, without a restart",
    )
    ledger_path: Path | None = Field(
        None,
        description="usage ledger file (default: $DEEPSERVE_HOME/gateway/usage.sqlite); put it on storage "
        "that outlives the process (a persistent volume)",
    )
    host: str = Field("127.0.0.1", description="address to listen on (anything but loopback requires keys)")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on (0: any free port)")
    require_keys: bool = Field(False, description="require an API key even on loopback")
    insecure_open: bool = Field(False, description="allow a non-loopback bind without keys (not recommended)")
    balancing: str = Field("least_outstanding", description="policy: " + ", ".join(BALANCING_POLICIES))
    session_header: str = Field("x-session-id", description="request header that session_affinity routes by")
    max_concurrency: int = Field(1024, ge=1, description="most requests forwarded at once (others wait in queue)")
    max_queue: int = Field(4096, ge=0, description="most requests waiting for a slot; beyond it: 503")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in the queue before a 503")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body accepted (413 beyond)")
    max_retries: int = Field(2, ge=0, description="retries on another replica while no byte reached the client")
    health_check_interval_s: float = Field(1.0, gt=0, description="seconds between upstream health checks")
    connect_timeout_s: float = Field(3.0, gt=0, description="upstream connect timeout")
    upstream_timeout_s: float = Field(600.0, gt=0, description="longest silence from an upstream mid-request")
    first_byte_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest wait for a replica's response head on a streamed request; then the replica leaves "
        "rotation and the request is retried on another",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a client must send its request line and headers within this (else 408, closed)"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a client must send its whole body within this after its headers (else 408, closed)"
    )
    max_header_bytes: int = Field(
        65536, ge=4096, description="largest request line plus headers accepted (431 and closed beyond)"
    )
    max_connections: int = Field(
        8192,
        ge=1,
        description="most client connections open at once (per worker with --workers); beyond it a new one gets "
        "503 and is closed",
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="on SIGTERM, time in-flight requests get to finish before streams are cut"
    )
    model_alias: list[str] = Field(
        default_factory=list, description="ALIAS=MODEL: clients may call MODEL by ALIAS; repeat for several"
    )
    default_chat_template_kwargs: list[str] = Field(
        default_factory=list,
        description="MODEL=JSON: chat template options sent for MODEL when a request leaves them out, e.g. "
        'deepseek-ai/DeepSeek-V3.1={"thinking": true} (a default thinking mode); repeat for several models',
    )
    max_model_len: int | None = Field(
        None, ge=1, description="context length for max_tokens validation (default: from the upstream /v1/models)"
    )
    log_bodies: bool = Field(False, description="store prompt and completion text in the usage ledger (opt-in)")
    access_log: bool = Field(False, description="print one line per request to stderr")
    redis_url: str | None = Field(
        None,
        description="share rpm/tpm, concurrency and revocations with every gateway using this Redis "
        "(redis://HOST:PORT/DB); without it limits are this process's own",
    )
    redis_fail_open: bool = Field(
        False, description="while Redis is unreachable, admit with this gateway's own limits instead of a 503"
    )
    redis_prefix: str = Field("deepserve:gateway:", description="prefix of every Redis key (one per deployment)")
    redis_lease_s: float = Field(
        10.0, gt=0, description="a concurrency slot held in Redis expires this long after its gateway stops renewing"
    )
    redis_timeout_s: float = Field(
        1.0, gt=0, description="longest wait for one answer from Redis (3 late answers in a row: unreachable)"
    )
    workers: int = Field(
        1,
        ge=1,
        description="gateway processes sharing the port and one set of limits (in memory they all map; in Redis "
        "with --redis-url)",
    )
    sched_slice_us: int = Field(
        DEFAULT_SLICE_US,
        ge=0,
        le=MAX_SLICE_US,
        description=f"the CPU time slice each gateway process asks Linux (6.12 or later) for, in µs ({MIN_SLICE_US} "
        "or more): a short one lets it preempt on wake-up and hand the core on as soon as it has woken a task; "
        "0 keeps the kernel's default",
    )
    limit_zone_keys: int = Field(
        65536,
        ge=16,
        description="keys whose limits the workers' shared table holds (--workers above 1 without --redis-url); "
        "keys that hold nothing are dropped when it fills",
    )
    score_weight: list[str] = Field(
        default_factory=list,
        description="NAME=WEIGHT for the engine_aware policy's scorers ("
        + ", ".join(f"{name}={weight:g}" for name, weight in DEFAULT_SCORE_WEIGHTS.items())
        + " unless given); repeat for several",
    )
    engine_metrics_interval_s: float = Field(
        0.2, gt=0, description="how often engine_aware scrapes each replica's /metrics"
    )

    @field_validator("balancing")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in BALANCING_POLICIES:
            raise ValueError(unknown_name("balancing policy", value, list(BALANCING_POLICIES)))
        return value

    @field_validator("sched_slice_us")
    @classmethod
    def _grantable_slice(cls, value: int) -> int:
        if 0 < value < MIN_SLICE_US:
            raise ValueError(
                f"{value} µs is below the shortest slice Linux grants ({MIN_SLICE_US} µs); give {MIN_SLICE_US} or "
                "more, or 0 for the kernel's default"
            )
        return value

    @field_validator("upstream", "prefill_upstream")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            check_upstream_url(url)
        return [url.rstrip("/") for url in value]

    @field_validator("model_alias")
    @classmethod
    def _alias_pairs(cls, value: list[str]) -> list[str]:
        for pair in value:
            alias, _, model = pair.partition("=")
            if not alias or not model:
                raise ValueError(f"model alias {pair!r} must look like ALIAS=MODEL")
        return value

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _template_pairs(cls, value: object) -> object:
        """MODEL=JSON strings; in a config file also a mapping {MODEL: {...}}. Each JSON must be an object."""
        if isinstance(value, dict):
            value = [f"{model}={json.dumps(options)}" for model, options in value.items()]
        for pair in value if isinstance(value, list) else []:
            _template_options(str(pair))
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None:
            RedisAddress.from_url(value)  # its ValueError says what is wrong, without the URL's password
        return value

    @field_validator("score_weight")
    @classmethod
    def _score_weights(cls, value: list[str]) -> list[str]:
        for pair in value:
            name, _, weight = pair.partition("=")
            if name not in DEFAULT_SCORE_WEIGHTS:
                raise ValueError(unknown_name("scorer", name, list(DEFAULT_SCORE_WEIGHTS)))
            try:
                number = float(weight)
            except ValueError:
                number = -1.0
            if not number >= 0:
                raise ValueError(f"score weight {pair!r} must look like NAME=WEIGHT with a WEIGHT of at least 0")
        return value

    def score_weights(self) -> dict[str, float]:
        given = {name: float(weight) for name, _, weight in (pair.partition("=") for pair in self.score_weight)}
        return {**DEFAULT_SCORE_WEIGHTS, **given}

    def chat_template_defaults(self) -> dict[str, dict[str, Any]]:
        """{model: chat template options} from default_chat_template_kwargs (a later pair for a model wins)."""
        return dict(_template_options(pair) for pair in self.default_chat_template_kwargs)

    def aliases(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for pair in self.model_alias)

    def keys_required(self) -> bool:
        """Keys are required when asked for, and on any non-loopback bind unless --insecure-open."""
        return self.require_keys or (not is_loopback(self.host) and not self.insecure_open)

    def check_startable(self) -> None:
        """Fail fast, before binding, on a configuration that cannot work."""
        if not self.upstream:
            raise ConfigError("no upstream given; pass --upstream http://HOST:PORT/v1 (repeat for replicas)")
        for flag, path in (("--keys-file", self.keys_file), ("--upstream-api-key-file", self.upstream_api_key_file)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag} {path} is not a readable file; give the file's path (a mounted Secret's)")


def _template_options(pair: str) -> tuple[str, dict[str, Any]]:
    model, _, text = pair.partition("=")
    example = 'e.g. deepseek-ai/DeepSeek-V3.1={"thinking": true}'
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not model or not isinstance(options, dict):
        raise ValueError(f"default chat template options {pair!r} must look like MODEL=JSON-OBJECT, {example}")
    return model, options


def check_upstream_url(url: str) -> None:
    """Raise ValueError, saying how to fix it, unless URL is an engine base URL the upstream client can use as is:
    http(s), an explicit host, a valid port, no credentials (they would not be sent), a plain ASCII path."""
    example = "e.g. http://127.0.0.1:8001/v1"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream {url!r} must be an http:// or https:// URL, {example}")
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise ValueError(
            f"upstream {url!r} has credentials (user@ or user:password@), which the gateway does not send to "
            f"engines; remove them (an engine's API key goes in --upstream-api-key-file), {example}"
        )
    if not parts.hostname:
        raise ValueError(f"upstream {url!r} has no host; give one, {example}")
    try:
        parts.port  # noqa: B018 (urlsplit checks the port only when it is read)
    except ValueError:
        raise ValueError(f"upstream {url!r} has an invalid port; use a number from 1 to 65535, {example}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"upstream {url!r} must not have a query or fragment; give the base URL only, {example}")
    if not (url.isascii() and url.isprintable()) or " " in url:
        raise ValueError(f"upstream {url!r} must be plain ASCII without spaces; percent-encode the path, {example}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def gateway_home() -> Path:
    """Keys and the usage ledger live here (0700: it holds key hashes and who used what)."""
    path = deepserve_home() / "gateway"
    make_private_dir(path)
    return path


def make_private_dir(path: Path) -> None:
    """Create PATH (and its parents) if needed, and leave PATH itself accessible to its owner only (0700)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if info.st_mode & 0o077 and info.st_uid == os.getuid():  # an existing directory of ours, too open
        path.chmod(0o700)


def gateway_argv(config: GatewayConfig, python: str = sys.executable) -> list[str]:
    """`python -m deepserve.cli.main gateway …` with every field that differs from its default."""
    return [python, "-m", "deepserve.cli.main", "gateway", *changed_flags(config)]


def base_url(config: GatewayConfig, port: int | None = None) -> str:
    return f"http://{url_host(config.host)}:{port or config.port}/v1"
