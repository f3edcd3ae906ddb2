"""What the gateway's timing takes: a clock, a callable that returns monotonic seconds (`time.monotonic` when
serving; a test passes one it moves by hand). Limits, connection deadlines, the upstream client, balancing and the
engines' load all read the one clock the app was given."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
