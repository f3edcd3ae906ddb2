"""The gateway's request to the CPU scheduler: a short time slice (Linux 6.12 and later).

A gateway's work comes in short runs between waits: a request head, or one engine step's tokens to relay. Linux's
fair scheduler (EEVDF) lets a running task keep its core for a whole slice (0.7-3 ms by default, growing with the
core count) before a task it woke may run. On a host where the gateway shares cores with the engine's API server,
a tokenizer or a client, whatever the gateway wakes (the engine's server with a request, a reader with a token)
then waits for the gateway to relay all of an engine step before it runs; and a gateway woken while another task
runs waits for that task's slice. With a short slice of its own (`sched_attr.sched_runtime`, which Linux 6.12 made
a fair task's slice) the kernel lets the gateway preempt a task with a longer slice when it wakes, and ends the
gateway's own turn sooner once it has woken another task: what a latency-sensitive relay wants. Its total work
stays the same.

Measured in docs/PERFORMANCE.md ("A short scheduler slice"): with 32 streams that arrive together and stream in
lockstep on 2 shared cores, the TTFT the gateway adds (p50) fell from +1.3-1.8 ms to +0.8-1.3 ms in three runs; at
256 streams no change stood out from the noise."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# The kernel accepts custom slices from 0.1 to 100 ms (kernel/sched/syscalls.c); 0 keeps the kernel's default.
MIN_SLICE_US = 100
MAX_SLICE_US = 100_000
# sched_setattr(2) and sched_getattr(2) have no wrapper in Python or glibc; their numbers per architecture.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    """`struct sched_attr` (include/uapi/linux/sched/types.h) as of Linux 5.3, which added the two util fields."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def request_time_slice(slice_us: int) -> str | None:
    """Ask for a SLICE_US time slice for the calling thread (the event loop's; threads and processes it starts later
    inherit it); None when it holds, else why it does not (an old kernel, another OS, another scheduling policy)."""
    if slice_us == 0:
        return None
    calls = _syscalls()
    if calls is None:
        return f"custom slices are a Linux feature (x86_64, aarch64), not {platform.system()} on {platform.machine()}"
    set_call, get_call = calls
    attr = _attr(get_call, 0)
    if attr is None:
        return f"sched_getattr failed ({os.strerror(ctypes.get_errno())})"
    if attr.sched_policy != os.SCHED_OTHER:
        return f"the gateway runs under scheduling policy {attr.sched_policy}, not SCHED_OTHER, and keeps it"
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags = 0
    attr.sched_runtime = slice_us * 1000
    if _libc().syscall(set_call, 0, ctypes.byref(attr), 0) != 0:
        return f"sched_setattr failed ({os.strerror(ctypes.get_errno())})"
    if current_time_slice_us() != slice_us:
        return f"this kernel ({platform.release()}) ignores custom slices; they need Linux 6.12 or later"
    return None


def current_time_slice_us(tid: int = 0) -> int | None:
    """The time slice of thread TID (0: the calling thread) in µs; None where Linux does not say (before 6.12 it
    reports 0 for a fair task, which is read as None too)."""
    calls = _syscalls()
    attr = None if calls is None else _attr(calls[1], tid)
    if attr is None or attr.sched_runtime == 0:
        return None
    return int(attr.sched_runtime // 1000)


def _syscalls() -> tuple[int, int] | None:
    return _SYSCALLS.get(platform.machine()) if platform.system() == "Linux" else None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _attr(get_call: int, tid: int) -> _SchedAttr | None:
    attr = _SchedAttr()
    if _libc().syscall(get_call, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return attr
