"""Python 3.10 support: the standard-library APIs of 3.11 that deepserve uses, with 3.10 stand-ins.

Ubuntu 22.04, common on GPU servers, ships Python 3.10. On 3.11 and later these names are the standard library's own.

- `timeout(delay_s)`: `asyncio.timeout`; on 3.10 the async-timeout backport (asyncio.timeout's origin), raising
  the builtin TimeoutError on expiry as 3.11 does (3.10's asyncio.TimeoutError is a different class).
- `wait_for_event(event, timeout_s)`: until an asyncio.Event is set or the time is up, never swallowing a
  cancellation that arrives as the time runs out: on 3.11 `asyncio.timeout`, not `asyncio.wait_for` (which on 3.11
  can swallow one that arrives just as the event is set: a benchmark that never ended in CI); on 3.10
  `asyncio.wait`, not the async-timeout backport (which has the same fault at its expiry).
- `run(coroutine, loop_factory=...)`: `asyncio.Runner(loop_factory=...).run(...)`, including its Ctrl-C handling:
  the first Ctrl-C cancels the main task (which may catch the cancellation and return partial results), a second
  one raises KeyboardInterrupt.

- `own_process_group()`: the keyword arguments to `subprocess.Popen` that start the child in a process group of its
  own, in our session: `process_group=0`, new in 3.11. On 3.10 the child gets a session of its own instead (see the
  function for what that costs).

Elsewhere, an except clause for a timeout of asyncio.wait_for or aiohttp names asyncio.TimeoutError too: on 3.10 that
is not the builtin TimeoutError.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]

if sys.version_info >= (3, 11):
    timeout = asyncio.timeout

else:  # pragma: no cover - exercised by the Python 3.10 test run

    @contextlib.asynccontextmanager
    async def timeout(delay_s: float | None) -> AsyncIterator[None]:
        import async_timeout

        try:
            async with async_timeout.timeout(delay_s):
                yield
        except asyncio.TimeoutError as exc:
            raise TimeoutError from exc


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until EVENT is set or TIMEOUT_S have passed, whichever comes first (the caller looks at the event after)."""
    if sys.version_info >= (3, 11):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
        return
    await _wait_for_event_310(event, timeout_s)  # pragma: no cover - exercised by the Python 3.10 test run


async def _wait_for_event_310(event: asyncio.Event, timeout_s: float) -> None:
    # Not async_timeout: without 3.11's uncancel it turns a cancellation that lands in the same loop iteration as
    # its own expiry into TimeoutError, which this function swallows; a Ctrl-C lost that way let a benchmark run
    # to its end in CI. asyncio.wait never swallows a cancellation of the task that awaits it.
    if event.is_set():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()


def run(coroutine: Coroutine[Any, Any, T], loop_factory: LoopFactory | None = None) -> T:
    """Run COROUTINE to completion on a new event loop from LOOP_FACTORY (asyncio's default when None)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(coroutine)
    return _run_310(coroutine, loop_factory)  # pragma: no cover - exercised by the Python 3.10 test run


def _run_310(coroutine: Coroutine[Any, Any, T], loop_factory: LoopFactory | None) -> T:
    loop = loop_factory() if loop_factory is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(coroutine)
    interrupts = [0]

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts[0] += 1
        if interrupts[0] == 1 and not task.done():
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)  # wake the loop from its selector
            return
        raise KeyboardInterrupt

    handled = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if handled:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        if interrupts[0]:
            raise KeyboardInterrupt from None
        raise
    finally:
        if handled and signal.getsignal(signal.SIGINT) is on_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _close(loop)


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """What asyncio.run does on the way out: cancel what is left, finish async generators and the executor."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def own_process_group() -> dict[str, Any]:
    """Popen's keywords for a child in its own process group (a terminal's Ctrl-C does not reach it; its group can be
    signalled whole) but in the caller's session. A new session would do the first two too, but where the kernel
    groups tasks by session for scheduling (autogroup: on in many distributions' kernels, and on the machine
    measured), it is also a new scheduling group with a whole CPU share of its own: the engine's busy workers then
    starve a mostly idle client in the caller's group for up to a second at a time (measured on Linux 6.18, 2 cores:
    a benchmark's 10 ms sleep took 0.9-2.0 s while vLLM ran a wave, with no such delay once everything shared one
    group)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}  # pragma: no cover - 3.10's Popen has no process_group
