"""Derive argparse flags from a config section, so the CLI never drifts from the typed config."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from pydantic import BaseModel

from deepserve.engines.config import EngineConfig
from deepserve.gateway.config import GatewayConfig

# The gateway's safety switches, on the command lines that start or render a gateway (serve, deploy render).
GATEWAY_SWITCHES = ("require_keys", "insecure_open")


def add_section_flags(
    parser: argparse.ArgumentParser,
    section: type[BaseModel],
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """One `--field-name` flag per field (of ONLY, when given). Defaults are None ("not given") so that the config
    file and the environment are only overridden by flags the user typed."""
    for name, field in section.model_fields.items():
        if name in skip or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        kind, choices = _scalar_type(field.annotation)
        help_text = f"{field.description or ''} (default: {field.get_default(call_default_factory=True)})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif kind is list:
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=choices, default=None, help=help_text)


def section_overrides(args: argparse.Namespace, section: type[BaseModel]) -> dict[str, Any]:
    """The flags of SECTION that the user gave (as a plain dict for `config.load_section`)."""
    return {name: getattr(args, name) for name in section.model_fields if getattr(args, name, None) is not None}


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, with the words after `--` as the engine's extra arguments."""
    overrides = section_overrides(args, EngineConfig)
    if args.passthrough:
        overrides["extra_args"] = args.passthrough
    return overrides


def add_gateway_switches(parser: argparse.ArgumentParser) -> None:
    for name in GATEWAY_SWITCHES:
        field = GatewayConfig.model_fields[name]
        parser.add_argument("--" + name.replace("_", "-"), action="store_true", default=None, help=field.description)


def gateway_switches(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in GATEWAY_SWITCHES}


def _scalar_type(annotation: Any) -> tuple[Any, list[str] | None]:
    """(python type, choices) of a field annotation, looking through Optional and Literal."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _scalar_type(inner[0])
    if origin is typing.Literal:
        return str, [str(choice) for choice in typing.get_args(annotation)]
    if origin is list:
        return list, None
    if origin is dict:
        return str, None  # JSON text; the field parses it
    return annotation, None
