"""deepserve._compat behaves as Python 3.11's asyncio.Runner and asyncio.timeout on every Python we support (CI runs
these tests under 3.10 too): the loop factory is used, a timeout raises the builtin TimeoutError, and Ctrl-C cancels
the main task, which may return partial results, while a second Ctrl-C interrupts."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from deepserve import _compat

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT to itself")


def test_run_returns_the_result_on_a_loop_from_the_factory():
    made: list[asyncio.AbstractEventLoop] = []

    def factory() -> asyncio.AbstractEventLoop:
        made.append(asyncio.new_event_loop())
        return made[0]

    async def main() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    assert _compat.run(main(), factory) is made[0]
    assert made[0].is_closed()
    assert _compat.run(main()) is not made[0]


def test_left_over_tasks_are_cancelled_and_the_loop_closed():
    cancelled: list[bool] = []
    left: list[asyncio.Future[None]] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> str:
        left.append(asyncio.ensure_future(forever()))
        await asyncio.sleep(0)
        return "done"

    assert _compat.run(main()) == "done"
    assert cancelled == [True]


def test_timeout_raises_the_builtin_timeout_error():
    async def main() -> None:
        async with _compat.timeout(0.01):
            await asyncio.Event().wait()

    with pytest.raises(TimeoutError) as caught:
        _compat.run(main())
    assert type(caught.value) is TimeoutError  # the builtin one (an OSError), not 3.10's asyncio.TimeoutError
    assert isinstance(caught.value, OSError)


def test_timeout_that_does_not_expire_changes_nothing():
    async def main() -> int:
        async with _compat.timeout(30):
            await asyncio.sleep(0)
        return 7

    assert _compat.run(main()) == 7


def test_wait_for_event_returns_when_set_or_when_the_time_is_up():
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, event.set)
        await _compat.wait_for_event(event, 30)
        idle = asyncio.Event()
        await _compat.wait_for_event(idle, 0.01)
        return event.is_set(), idle.is_set()

    assert _compat.run(main()) == (True, False)


def test_a_cancellation_as_the_wait_runs_out_is_not_swallowed():
    """The wait's expiry and a cancellation handled in the same loop iteration: the cancellation wins (3.10's
    async-timeout turned it into a timeout, which wait_for_event swallowed: a Ctrl-C lost, a benchmark ran on)."""

    async def main() -> str:
        event = asyncio.Event()

        async def waiter() -> str:
            await _compat.wait_for_event(event, 0.01)
            return "ran on"

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)  # the task waits
        time.sleep(0.05)  # its time is up; the loop has not seen it yet
        await asyncio.sleep(0)
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert _compat.run(main()) == "cancelled"


def test_ctrl_c_cancels_the_main_task_which_may_return_partial_results():
    async def main() -> str:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "partial"
        return "never"

    assert _compat.run(main()) == "partial"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_ctrl_c_that_the_task_does_not_handle_is_a_keyboard_interrupt():
    async def main() -> None:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
        await asyncio.Event().wait()

    with pytest.raises(KeyboardInterrupt):
        _compat.run(main())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_interrupts_a_task_that_ignores_the_first():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
            await asyncio.Event().wait()  # cleaning up forever: the second Ctrl-C must still get out

    with pytest.raises(KeyboardInterrupt):
        _compat.run(main())
