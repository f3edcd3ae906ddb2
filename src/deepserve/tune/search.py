"""The highest load at which every SLO holds, for one engine config: the request rate (open loop) or the concurrency
(closed loop), found by bisection between a load that held and one that missed.

vLLM's auto-tune first runs at an unlimited rate and, when its latency bound is missed, steps the rate down by one
request/s from the measured throughput until the bound holds. Here the first rate probed is the completed rate of
the point's own run (the server's capacity at that load), and the bracket halves at each further probe, so a
bounded number of runs (`steps`) narrows the answer to a tolerance whatever its scale. Along concurrency the search
also grows (doubling) while the SLOs hold, since a higher concurrency may still meet them.

A held load above a missed one (noise at the edge) is not counted: the answer is the highest load that held below
the lowest load that missed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SearchAxis = Literal["request_rate", "max_concurrency"]


@dataclass(frozen=True)
class SearchOptions:
    axis: SearchAxis
    steps: int = 5  # benchmark runs the search may add to a point
    tolerance: float = 0.1  # a rate bracket narrower than this fraction of its top is close enough


@dataclass(frozen=True)
class Probe:
    """One benchmark run of the search."""

    load: float  # requests/s, or concurrent requests
    holds: bool  # every SLO held
    goodput_output_tok_s: float
    output_tok_s: float
    summary: dict[str, Any] = field(default_factory=dict)  # the run's headline metrics

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SearchOutcome:
    axis: SearchAxis
    max_load: float | None  # the highest load that held (None: none did)
    missed_above: float | None  # the lowest load that missed (None: none above max_load was found to miss)
    probes: tuple[Probe, ...]

    @property
    def best_probe(self) -> Probe | None:
        return next((probe for probe in self.probes if probe.load == self.max_load and probe.holds), None)

    def words(self) -> str:
        unit = "requests/s" if self.axis == "request_rate" else "concurrent requests"
        if self.max_load is None:
            lowest = min(probe.load for probe in self.probes) if self.probes else math.nan
            return f"the SLOs missed at every load tried (down to {lowest:g} {unit})"
        if self.missed_above is None and self.axis == "request_rate":
            return f"the SLOs held at {self.max_load:g} {unit}, the rate the server completed (more only queues)"
        if self.missed_above is None:
            return f"the SLOs held up to {self.max_load:g} {unit}, the most tried"
        return f"the SLOs hold up to {self.max_load:g} {unit} (missed at {self.missed_above:g})"

    def to_json(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "max_load": self.max_load,
            "missed_above": self.missed_above,
            "words": self.words(),
            "probes": [probe.to_json() for probe in self.probes],
        }


Measure = Callable[[float], Probe]


def search_max_load(
    measure: Measure,
    options: SearchOptions,
    start: float,
    known: Sequence[Probe] = (),
    ceiling: float | None = None,
) -> SearchOutcome:
    """Probe START (unless KNOWN already holds a run there), then bisect, growing along concurrency up to CEILING
    while the SLOs hold, for at most OPTIONS.steps new runs."""
    probes = list(known)
    added = 0
    if all(probe.load != start for probe in probes):
        probes.append(measure(start))
        added += 1
    while added < options.steps:
        load = next_load(probes, options, ceiling)
        if load is None:
            break
        probes.append(measure(load))
        added += 1
    held, missed = bracket(probes)
    return SearchOutcome(options.axis, held, missed, tuple(probes))


def bracket(probes: Sequence[Probe]) -> tuple[float | None, float | None]:
    """(highest load that held below the lowest that missed, lowest load that missed)."""
    missed = min((probe.load for probe in probes if not probe.holds), default=None)
    held = [probe.load for probe in probes if probe.holds and (missed is None or probe.load < missed)]
    return (max(held) if held else None), missed


def next_load(probes: Sequence[Probe], options: SearchOptions, ceiling: float | None) -> float | None:
    """The load to try next, or None when the bracket is as narrow as it gets."""
    held, missed = bracket(probes)
    integer = options.axis == "max_concurrency"
    if missed is None:  # everything held
        if not integer or held is None:
            return None  # a rate above the capacity the server completed only builds a queue
        grown = held * 2 if ceiling is None else min(held * 2, ceiling)
        return grown if grown > held else None
    if held is None:
        lower = math.floor(missed / 2) if integer else missed / 2
        return lower if lower >= (1 if integer else 1e-3) else None
    if integer:
        middle = math.floor((held + missed) / 2)
        return middle if held < middle < missed else None
    if missed - held <= options.tolerance * missed:
        return None
    return (held + missed) / 2


def outcome_from_json(data: dict[str, Any]) -> SearchOutcome:
    """A search as the point's result file stores it (`SearchOutcome.to_json`)."""
    probes = tuple(Probe(**_renamed(probe)) for probe in data.get("probes") or [])
    return SearchOutcome(data["axis"], data.get("max_load"), data.get("missed_above"), probes)


# Keys renamed since results were first written: old tune directories keep reading.
RENAMED_KEYS = {"goodput_tok_s": "goodput_output_tok_s"}


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    return {RENAMED_KEYS.get(key, key): value for key, value in data.items()}
