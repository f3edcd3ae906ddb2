"""`deepserve keys`: create, list, revoke and export the gateway's API keys (stored hashed under DEEPSERVE_HOME)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepserve.config import load_section
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.limits import KeyLimits


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="create, list and revoke gateway API keys")
    commands = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    create = commands.add_parser("create", help="create a key and print it once")
    create.add_argument("name", help="a unique name for the key (shown in usage and metrics)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute, at least 1 (default: unlimited)")
    create.add_argument(
        "--tpm", type=int, default=None, help="prompt + completion tokens per minute, at least 1 (default: unlimited)"
    )
    create.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight at once (default: unlimited)"
    )
    create.add_argument("--models", default=None, help="comma-separated models the key may use (default: all)")
    create.set_defaults(handler=_create)

    listing = commands.add_parser("list", help="list keys (never their secrets)")
    listing.set_defaults(handler=_list)

    revoke = commands.add_parser("revoke", help="revoke a key (the gateway stops accepting it within a second)")
    revoke.add_argument("name")
    revoke.add_argument(
        "--redis-url",
        default=None,
        help="also tell every gateway sharing this Redis at once (default: the gateway config's redis_url, if any; "
        "a gateway with --redis-url on this host publishes it within a second anyway)",
    )
    revoke.add_argument("--config", type=Path, default=None, help="config file whose `gateway` section to read")
    revoke.set_defaults(handler=_revoke)

    export = commands.add_parser(
        "export",
        help="write every key (hashes only, revoked ones marked) to a file for `deepserve gateway --keys-file` "
        "(e.g. a Kubernetes Secret: kubectl create secret generic gateway-keys --from-file=keys.json=FILE)",
    )
    export.add_argument("--output", type=Path, required=True, help="the file to write (replaced whole)")
    export.set_defaults(handler=_export)


def _create(args: argparse.Namespace) -> int:
    models = [name.strip() for name in args.models.split(",") if name.strip()] if args.models else None
    store = KeyStore()
    try:
        key, secret = store.create(args.name, KeyLimits(args.rpm, args.tpm, args.max_concurrency), models)
    finally:
        store.close()
    print(secret)
    Console(stderr=True).print(f"created key {key.name!r} (id {key.id}); it is shown only this once, store it now")
    return 0


def _list(args: argparse.Namespace) -> int:
    store = KeyStore()
    try:
        keys = store.all_keys()
    finally:
        store.close()
    table = Table("name", "id", "rpm", "tpm", "max concurrency", "models", "created", "status")
    for key in keys:
        limits = key.limits
        table.add_row(
            key.name,
            key.id,
            _limit(limits.rpm),
            _limit(limits.tpm),
            _limit(limits.max_concurrency),
            ",".join(sorted(key.models)) if key.models else "all",
            _when(key.created_at),
            f"revoked {_when(key.revoked_at)}" if key.revoked_at else "active",
        )
    Console().print(table)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    gateway = load_section(GatewayConfig, "gateway", args.config, {"redis_url": args.redis_url})
    store = KeyStore()
    try:
        key = store.revoke(args.name)
    finally:
        store.close()
    print(f"revoked key {args.name!r}")
    if gateway.redis_url and key.revoked_at is not None:
        from deepserve.gateway.shared_limits import publish_revocation_now, redis_where

        try:
            publish_revocation_now(gateway.redis_url, gateway.redis_prefix, key.id, key.revoked_at)
        except Exception as exc:  # the key is revoked here; only the news to other hosts is late
            Console(stderr=True).print(
                f"could not tell the gateways through Redis at {redis_where(gateway.redis_url)} ({exc}); a gateway "
                "using this key database publishes the revocation within a second of noticing it"
            )
            return 1
        print(f"published the revocation to the gateways sharing Redis at {redis_where(gateway.redis_url)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    store = KeyStore()
    try:
        count = store.export(args.output)
    finally:
        store.close()
    print(f"wrote {count} keys (hashes only) to {args.output}")
    return 0


def _limit(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
