"""Resume: a sweep directory's index records each point's status as it finishes, so a re-run of the same sweep keeps
finished points and runs the rest; a directory holding a different sweep is refused rather than mixed."""

from __future__ import annotations

from pathlib import Path

from deepserve.errors import ConfigError
from deepserve.results.sweepdir import PointEntry, SweepIndex, read_index, write_index
from deepserve.sweep.grid import SweepPoint, SweepSpec


def prepare_index(directory: Path, spec: SweepSpec) -> SweepIndex:
    """The index to run: the existing one when it records the same sweep (resume), else a new one. A directory
    that holds a different sweep's finished points is refused rather than mixed."""
    index = SweepIndex(
        label=spec.label,
        suite=spec.suite,
        signature=spec.signature,
        sweep_axis=spec.sweep_axis,
        metadata=spec.metadata,
    )
    for point in spec.points:
        index.points.append(PointEntry(point_id=point.point_id, params=point.params, overrides=point.overrides))
    return resume_or_start(directory, index)


def resume_or_start(directory: Path, fresh: SweepIndex) -> SweepIndex:
    """DIRECTORY's index when it has FRESH's signature (a resume), else FRESH, written there. A directory whose
    index holds another signature's finished points is refused rather than mixed (`deepserve tune` shares this)."""
    index = read_index(directory)
    if index is not None:
        if index.signature == fresh.signature:
            return index
        if any(entry.status == "done" for entry in index.points):
            raise ConfigError(
                f"{directory} already holds a different sweep ({index.suite or 'grid'} '{index.label}'); "
                "pick another directory, or delete that one to start over"
            )
    write_index(directory, fresh)
    return fresh


def stored_points(index: SweepIndex) -> list[SweepPoint]:
    """The points an index planned (a resumed suite runs exactly what was planned, without probing again)."""
    return [SweepPoint(entry.point_id, dict(entry.overrides), entry.params.get("variant")) for entry in index.points]
