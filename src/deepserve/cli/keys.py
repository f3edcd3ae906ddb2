"""`deepserve keys`: create, list and revoke the gateway's API keys (stored hashed under DEEPSERVE_HOME)."""

from __future__ import annotations

import argparse
import datetime

from rich.console import Console
from rich.table import Table

from deepserve.gateway.keys import KeyStore
from deepserve.gateway.limits import KeyLimits


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="create, list and revoke gateway API keys")
    commands = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    create = commands.add_parser("create", help="create a key and print it once")
    create.add_argument("name", help="a unique name for the key (shown in usage and metrics)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="prompt + completion tokens per minute")
    create.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    create.add_argument("--models", default=None, help="comma-separated models the key may use (default: all)")
    create.set_defaults(handler=_create)

    listing = commands.add_parser("list", help="list keys (never their secrets)")
    listing.set_defaults(handler=_list)

    revoke = commands.add_parser("revoke", help="revoke a key (the gateway stops accepting it within a second)")
    revoke.add_argument("name")
    revoke.set_defaults(handler=_revoke)


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
    store = KeyStore()
    try:
        store.revoke(args.name)
    finally:
        store.close()
    print(f"revoked key {args.name!r}")
    return 0


def _limit(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
