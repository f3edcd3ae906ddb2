"""Resume: a sweep directory's index records each point's status as it finishes, so a re-run of the same sweep keeps
finished points and runs the rest; a directory holding a different sweep is refused rather than mixed.

`run_points` is the one resumable-point loop, shared by `deepserve sweep` (sweep/run.py) and `deepserve tune`
(tune/run.py): each point is kept when it finished earlier, skipped for a stated reason (saturation, a budget, a
plan that says it cannot fit), or run; the index is rewritten after every change, so a re-run resumes exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from deepserve.errors import ConfigError
from deepserve.results.sweepdir import PointEntry, SweepIndex, read_index, write_index
from deepserve.sweep.grid import SweepPoint, SweepSpec

Outcome = Literal["done", "failed", "interrupted"]
Progress = Callable[[str], None]


@dataclass
class PointTask:
    """One point of a resumable loop: its index entry, how it is named in progress lines, and what to do."""

    entry: PointEntry
    words: str  # "[3/13] c=16 rate=inf in=1024 out=256"
    run: Callable[[], Outcome]  # runs it, records the entry (status, note, result) and says how it went
    earlier: str | None = None  # "done" or "failed" when its finished earlier result is kept: it does not run again
    skip_reason: Callable[[], str | None] = lambda: None  # asked just before it would start
    starting: str = "running"  # the progress line's words as it starts


@dataclass
class LoopCounts:
    ran: int = 0
    kept: int = 0
    skipped: int = 0
    failed: int = 0
    interrupted: bool = False

    def as_dict(self) -> dict[str, int]:
        return {"ran": self.ran, "kept": self.kept, "skipped": self.skipped, "failed": self.failed}


def run_points(
    directory: Path, index: SweepIndex, tasks: Iterable[PointTask], progress: Progress, stop_on_failure: bool
) -> LoopCounts:
    """Keep, skip or run each task in order (see the module doc). Ctrl-C (KeyboardInterrupt) or a task that says
    "interrupted" ends the loop with counts.interrupted; a failed point ends it too with STOP_ON_FAILURE (a sweep
    whose server is gone), else the loop goes on (a tune whose engine failed to start at one point)."""
    counts = LoopCounts()
    for task in tasks:
        entry = task.entry
        if task.earlier is not None:
            counts.kept += task.earlier == "done"
            counts.failed += task.earlier != "done"
            progress(f"{task.words}: kept ({task.earlier} earlier{': ' + entry.note if entry.note else ''})")
            continue
        reason = task.skip_reason()
        if reason:
            mark_skipped(directory, index, entry, reason)
            counts.skipped += 1
            progress(f"{task.words}: skipped, {reason}")
            continue
        progress(f"{task.words}: {task.starting}")
        try:
            outcome = task.run()
        except KeyboardInterrupt:
            outcome = "interrupted"
        if outcome == "interrupted":
            counts.interrupted = True
            progress(f"{task.words}: interrupted; re-run the same command to resume")
            break
        counts.ran += outcome == "done"
        counts.failed += outcome == "failed"
        progress(f"{task.words}: {entry.note}")
        if outcome == "failed" and stop_on_failure:
            break
    return counts


def mark_skipped(directory: Path, index: SweepIndex, entry: PointEntry, reason: str) -> None:
    entry.status, entry.note = "skipped", reason
    write_index(directory, index)


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
