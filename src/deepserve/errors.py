"""Errors a user can act on. Each message says what was wrong and how to fix it."""


class DeepserveError(Exception):
    """Base of every error that the CLI prints as a one-line message instead of a traceback."""


class ConfigError(DeepserveError):
    """Bad configuration, found before any work starts."""


class ModelError(DeepserveError):
    """A model name, path or config.json that cannot be used."""


class EngineError(DeepserveError):
    """The engine could not be launched or died."""


def unknown_name(kind: str, name: str, valid: list[str]) -> str:
    """The message for a name that is not in a registry: lists the valid ones."""
    return f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}"
