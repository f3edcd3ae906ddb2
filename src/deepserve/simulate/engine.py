"""The simulated engine on a clock: requests in, tokens out to each request's sink at their simulated times.

Two engines behind one interface:
- `SteppedEngine`: the engine core (continuous batching, KV cache, pipeline) stepping on the clock. Steps follow
  each other on an ideal timeline (a step starts when the one before ended, not when its timer callback happened
  to run), so the event loop's timer resolution does not add up over thousands of steps, and a loop delayed by a
  busy machine catches up. If it falls behind by more than MAX_LAG_WALL_S, the timeline restarts at the present
  and the simulated time lost is counted.
- `FixedLatencyEngine`: every request on its own, first token TTFT after arrival, then one every ITL on an ideal
  timeline, whatever else runs (a fake OpenAI server's timing: no batching, no cache, staggered streams). With no
  ITL it streams as fast as each client reads: a stream whose connection is backed up pauses until it drains.

Everything runs in clock callbacks, never in tasks: no wake-ups beyond one timer for the next event.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from deepserve.simulate.clock import SimClock, Timer
from deepserve.simulate.core import EngineCore
from deepserve.simulate.metrics import CounterReading, EngineMetrics, GaugeReading
from deepserve.simulate.scheduler import SimRequest, Status, StepOutput, stop_reason
from deepserve.simulate.tokenizer import generated_token

MAX_LAG_WALL_S = 0.5  # how far (wall seconds) the loop may run behind the ideal timeline before it stops catching up
_EPS_S = 1e-9
FIXED_BURST_TOKENS = 64  # with no inter-token delay, tokens sent per callback before other streams get a turn


class SimEngine(Protocol):
    """What the server needs of an engine."""

    max_model_len: int
    metrics: EngineMetrics

    def submit(self, request: SimRequest) -> None: ...

    def abort(self, request: SimRequest) -> None: ...

    def pause(self, request: SimRequest) -> None:
        """REQUEST's client cannot take more for now (its connection's buffer is full)."""

    def resume(self, request: SimRequest) -> None:
        """It can again."""

    def now(self) -> float: ...

    def gauges(self) -> GaugeReading: ...

    def counters(self) -> CounterReading: ...

    def stats(self) -> dict[str, Any]: ...


class SteppedEngine:
    def __init__(self, core: EngineCore, clock: SimClock) -> None:
        self.core = core
        self.clock = clock
        self.max_model_len = core.max_model_len
        self.metrics = core.metrics
        self.max_lag_s = MAX_LAG_WALL_S / clock.wall_s(1.0)  # in simulated seconds
        self.lag_s = 0.0  # simulated time lost to an event loop that fell behind
        self.lag_events = 0
        self._ready_s = 0.0  # earliest start of the next step: the last arrival or step end that allowed one
        self._blocked = False  # nothing schedulable until an arrival, an abort or a step's end
        self._timer: Timer | None = None
        self._timer_s = math.inf
        self._kick_pending = False
        self._held: set[str] = set()  # submitted, still in the per-request overhead before the scheduler sees them

    def now(self) -> float:
        return self.clock.now()

    def submit(self, request: SimRequest) -> None:
        """REQUEST arrived now; the scheduler sees it after the engine profile's per-request overhead (the API
        server's work before a request can be scheduled, which no step accounts for)."""
        request.arrival_s = self.clock.now()
        delay_s = self.core.timer.request_overhead_s
        if delay_s > 0:
            self._held.add(request.request_id)
            self.clock.call_at(request.arrival_s + delay_s, lambda: self._admit(request))
        else:
            self._admit(request)

    def _admit(self, request: SimRequest) -> None:
        if request.request_id in self._held:
            self._held.discard(request.request_id)
        elif self.core.timer.request_overhead_s > 0:
            return  # aborted while the API server held it
        self.core.add(request)
        self._unblock(self.clock.now())

    def abort(self, request: SimRequest) -> None:
        if request.request_id in self._held:
            self._held.discard(request.request_id)  # not with the scheduler yet
            return
        if self.core.abort(request, self.clock.now()):
            self._unblock(self.clock.now())  # its blocks are free: a waiting request may fit now

    def pause(self, request: SimRequest) -> None:
        """Nothing: a real engine keeps generating whatever a client reads (vLLM's API server buffers it)."""

    def resume(self, request: SimRequest) -> None:
        pass

    def gauges(self) -> GaugeReading:
        return self.core.gauges()

    def counters(self) -> CounterReading:
        return self.core.counters()

    def stats(self) -> dict[str, Any]:
        scheduler = self.core.scheduler
        return {
            "mode": "stepped",
            "steps": scheduler.counters.steps,
            "busy_s": round(self.core.busy_s, 6),
            "lag_s": round(self.lag_s, 6),
            "lag_events": self.lag_events,
            "kv_blocks": scheduler.kv.pool.num_blocks,
            "kv_blocks_free": scheduler.kv.pool.num_free,
        }

    # ---- the event loop ---------------------------------------------------------------------------------------

    def _unblock(self, now_s: float) -> None:
        self._blocked = False
        self._ready_s = max(self._ready_s, now_s)
        if self.core.has_room and not self._kick_pending:
            self._kick_pending = True
            self.clock.call_soon(self._kick)

    def _kick(self) -> None:
        self._kick_pending = False
        self._advance()

    def _on_timer(self) -> None:
        self._timer, self._timer_s = None, math.inf
        self._advance()

    def _advance(self) -> None:
        """Handle, in time order, every step end and step start due by now; then wait for the next one."""
        now = self.clock.now()
        core = self.core
        while True:
            finish_s, start_s = core.next_finish_s, self._next_start_s(now)
            if min(finish_s, start_s) > now + _EPS_S:
                break
            if finish_s <= start_s:
                step, outputs = core.finish_step()
                self._blocked = False
                self._ready_s = max(self._ready_s, step.finish_s)
                _deliver(outputs, step.finish_s)
            elif core.start_step(start_s) is None:
                self._blocked = True
        self._arm(min(core.next_finish_s, self._next_start_s(now)))

    def _next_start_s(self, now: float) -> float:
        core = self.core
        if self._blocked or not core.has_room or not core.has_unfinished:
            return math.inf
        start_s = max(self._ready_s, core.entry_free_s)
        if now - start_s > self.max_lag_s:
            self.lag_s += now - start_s
            self.lag_events += 1
            self._ready_s = start_s = now
        return start_s

    def _arm(self, when_s: float) -> None:
        if when_s == self._timer_s:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_s = None, math.inf
        if when_s < math.inf:
            self._timer, self._timer_s = self.clock.call_at(when_s, self._on_timer), when_s


def _deliver(outputs: list[StepOutput], now_s: float) -> None:
    for output in outputs:
        request = output.request
        if request.sink is not None:
            request.sink.on_tokens(request, output.token_ids, output.finish_reason, now_s)


class FixedLatencyEngine:
    """Each request alone: its first token TTFT_S after it arrived, then one every ITL_S (0: as fast as the
    event loop runs and the client reads, BURST_TOKENS per turn, written together). Tokens are due on an ideal timeline
    (arrival + TTFT + i x ITL), so late timer callbacks do not add up; a loop that falls more than MAX_LAG_WALL_S
    behind restarts a stream's timeline at the present."""

    def __init__(
        self, clock: SimClock, ttft_s: float, itl_s: float, max_model_len: int, burst_tokens: int = FIXED_BURST_TOKENS
    ) -> None:
        if ttft_s < 0 or itl_s < 0:
            raise ValueError("fixed timings must not be negative")
        if burst_tokens < 1:
            raise ValueError("burst_tokens must be at least 1")
        self.clock = clock
        self.burst_tokens = burst_tokens
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.max_model_len = max_model_len
        self.metrics = EngineMetrics(max_model_len)
        self.max_lag_s = MAX_LAG_WALL_S / clock.wall_s(1.0)  # in simulated seconds
        self.active: dict[int, SimRequest] = {}
        self._timers: dict[int, Timer] = {}
        self._due_s: dict[int, float] = {}  # when each active request's next token is due
        self._paused: set[int] = set()  # requests whose client is backed up: no timer until it resumes
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def now(self) -> float:
        return self.clock.now()

    def submit(self, request: SimRequest) -> None:
        now = self.clock.now()
        request.arrival_s = request.first_scheduled_s = now
        request.status = Status.RUNNING
        key = id(request)
        self.active[key] = request
        # A prompt whose KV cache was prefilled elsewhere (a remote prefill) has its first token after one step
        self._due_s[key] = now + (self.itl_s if request.num_external_tokens else self.ttft_s)
        self._arm(request)

    def abort(self, request: SimRequest) -> None:
        if self.active.get(id(request)) is None:
            return
        self._forget(request)
        request.status, request.finish_reason = Status.FINISHED, "abort"
        self._observe_finished(request, self.clock.now())

    def pause(self, request: SimRequest) -> None:
        key = id(request)
        if key in self.active and key not in self._paused:
            self._paused.add(key)
            timer = self._timers.pop(key, None)
            if timer is not None:
                timer.cancel()

    def resume(self, request: SimRequest) -> None:
        key = id(request)
        if key in self._paused:
            self._paused.discard(key)
            if key in self.active:
                self._arm(request)

    def _arm(self, request: SimRequest) -> None:
        key = id(request)
        if key not in self._paused:
            self._timers[key] = self.clock.call_at(self._due_s[key], lambda: self._emit(request))

    def _forget(self, request: SimRequest) -> None:
        key = id(request)
        self.active.pop(key, None)
        self._due_s.pop(key, None)
        self._paused.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _emit(self, request: SimRequest) -> None:
        key = id(request)
        self._timers.pop(key, None)
        if request.finished:
            return
        now = self.clock.now()
        tokens, reason = self._next_tokens(request, self.burst_tokens if self.itl_s == 0 else 1)
        self._observe_tokens(request, len(tokens), now)
        if reason is not None:
            request.status, request.finish_reason = Status.FINISHED, reason
            self._forget(request)
            self._observe_finished(request, now)
        else:
            due_s = self._due_s[key] + self.itl_s
            self._due_s[key] = now if now - due_s > self.max_lag_s else due_s
            self._arm(request)
        if request.sink is not None:
            request.sink.on_tokens(request, tokens, reason, now)

    def _next_tokens(self, request: SimRequest, burst: int) -> tuple[list[int], str | None]:
        """Up to BURST tokens of REQUEST, and why it stops after them (None: it goes on)."""
        if burst > 1 and (request.eos_after is None or request.ignore_eos):  # only its length can end it: in bulk
            position = len(request.output_token_ids)
            room = min(request.max_tokens - position, self.max_model_len - request.num_tokens)
            tokens = [generated_token(p) for p in range(position, position + max(min(burst, room), 1))]
            request.output_token_ids.extend(tokens)
            request.num_tokens += len(tokens)
            return tokens, stop_reason(request, tokens[-1], self.max_model_len)
        tokens = []
        reason = None
        while reason is None and len(tokens) < burst:
            token = request.next_token()
            request.append_output(token)
            tokens.append(token)
            reason = stop_reason(request, token, self.max_model_len)
        return tokens, reason

    def _observe_tokens(self, request: SimRequest, count: int, now: float) -> None:
        if request.first_token_s is None:
            request.first_token_s = now
            self._prompt_tokens += request.num_prompt_tokens
            self.metrics.ttft.observe(now - request.arrival_s)
        else:
            self.metrics.itl.observe(now - (request.last_token_s or now))
        if count > 1:
            self.metrics.itl.observe_many(0.0, count - 1)  # the tokens of one burst come at the same instant
        request.last_token_s = now
        self._generation_tokens += count

    def _observe_finished(self, request: SimRequest, now: float) -> None:
        self.metrics.observe_finished(
            request.finish_reason or "abort",
            request.arrival_s,
            request.first_scheduled_s,
            request.first_token_s,
            now,
            request.num_prompt_tokens,
            len(request.output_token_ids),
        )

    def gauges(self) -> GaugeReading:
        return GaugeReading(running=len(self.active), waiting=0, kv_cache_usage=0.0)

    def counters(self) -> CounterReading:
        return CounterReading(self._prompt_tokens, self._generation_tokens, 0, 0, 0)

    def stats(self) -> dict[str, Any]:
        return {"mode": "fixed-latency", "ttft_s": self.ttft_s, "itl_s": self.itl_s, "active": len(self.active)}
