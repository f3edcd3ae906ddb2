"""One validated config tree: defaults ← config file ← environment (DEEPSERVE_*) ← CLI flags.

This module is the mechanism only (it imports no other layer); each section lives with the package it configures
(`engines.config.EngineConfig`, `serve.config.ServeConfig`, `gateway.config.GatewayConfig`, …). Each section is a
pydantic model. CLI flags are derived from the fields (see `deepserve.cli.flags`), environment
variables are named DEEPSERVE_<SECTION>__<FIELD> (e.g. DEEPSERVE_ENGINE__MAX_MODEL_LEN=16384), and a YAML or
JSON file given with --config (or DEEPSERVE_CONFIG) holds the same tree: {"engine": {"max_model_len": 16384}}.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from deepserve.errors import ConfigError

ENV_PREFIX = "DEEPSERVE_"


def deepserve_home() -> Path:
    """Where deepserve keeps its state: cached models, logs, keys, usage ledger, results."""
    return Path(os.environ.get("DEEPSERVE_HOME") or Path.home() / ".deepserve").expanduser()


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


T = TypeVar("T", bound=BaseModel)


def changed_fields(section: BaseModel, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """SECTION's fields whose values differ from their defaults (what a command line or config file must carry)."""
    return {
        name: getattr(section, name)
        for name, field in type(section).model_fields.items()
        if name not in skip and getattr(section, name) != field.get_default(call_default_factory=True)
    }


def changed_flags(section: BaseModel, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that reproduce SECTION's non-default fields (the inverse of the flags derived from
    the fields in `deepserve.cli.flags`): `--field-name VALUE`, `--flag`/`--no-flag` for booleans."""
    argv: list[str] = []
    for name, value in changed_fields(section, skip).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def load_section(model: type[T], section: str, file: Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Build SECTION of the tree: defaults, then the file, then DEEPSERVE_<SECTION>__* variables, then OVERRIDES
    (the CLI flags the user actually gave; None values mean "not given")."""
    values: dict[str, Any] = {}
    values.update(_file_values(file).get(section, {}))
    values.update(_env_values(section, model))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validate_section(model, section, values)


def validate_section(model: type[T], section: str, values: dict[str, Any]) -> T:
    """MODEL from VALUES, or a ConfigError naming each field of SECTION that is wrong (for sections built in code
    from the user's flags, as well as loaded ones)."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(section, exc)) from exc


def _file_values(file: Path | None) -> dict[str, Any]:
    file = file or (Path(os.environ[ENV_PREFIX + "CONFIG"]) if os.environ.get(ENV_PREFIX + "CONFIG") else None)
    if file is None:
        return {}
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist; pass an existing YAML or JSON file")
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {file} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a mapping of sections, e.g. engine: {{port: 8000}}")
    return data


def _env_values(section: str, model: type[BaseModel]) -> dict[str, Any]:
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    values: dict[str, Any] = {}
    for key, raw in os.environ.items():
        if not key.startswith(prefix):
            continue
        field = key[len(prefix) :].lower()
        if field not in model.model_fields:
            valid = ", ".join(prefix + name.upper() for name in model.model_fields)
            raise ConfigError(f"unknown environment variable {key}; valid: {valid}")
        values[field] = _parse_env_value(raw)
    return values


def _parse_env_value(raw: str) -> Any:
    """JSON where it parses (numbers, booleans, lists), else the plain string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _describe_validation_error(section: str, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join([section, *(str(part) for part in error["loc"])])
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            message += f" (got {error.get('input')!r})"
        # else a check across fields: its input is the whole section, and its message names the flags involved
        problems.append(f"{where}: {message}")
    return "invalid configuration: " + "; ".join(problems)


def parse_key_values(flag: str, pairs: list[str], example: str) -> dict[str, str]:
    """Repeated `FLAG KEY=VALUE` arguments as a dict; one without `=` or a key is refused with EXAMPLE."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {pair!r} must look like KEY=VALUE, e.g. {flag} {example}")
        parsed[key.strip()] = value
    return parsed
