"""Continuous batching as vLLM's V1 scheduler does it (vllm/v1/core/sched/scheduler.py, first-come-first-served).

There are no prefill and decode phases: each request has tokens (prompt, then what it generated) and computed
tokens, and every step gives requests tokens to compute, within a token budget (max_num_batched_tokens):

1. Running requests first, in order: each gets what it lacks (one token when decoding; the rest of its prompt, cut
   to the budget, when prefilling). When the cache has no block for it, the most recently admitted running
   request is preempted (its blocks freed, its progress dropped: it is recomputed later) and put back at the head
   of the waiting queue, until the request fits or was itself preempted.
2. Then, only if nobody was preempted in this step, waiting requests in arrival order, while the budget lasts and
   fewer than max_num_seqs run: the prefix cache covers what it can, the rest is scheduled (cut to the budget when
   chunked prefill is on; without it a prompt that does not fit the remaining budget waits). The first request
   that finds no room in the cache stops admission for this step.

After the step, every request whose scheduled tokens reached the end of its sequence samples one token; a prompt
cut short (a chunk) samples nothing. A request stops at max_tokens, at max_model_len, or at the model's end of
sequence (unless ignore_eos, and never before min_tokens).

With speculative decoding (`Drafting`), every request that sampled gets K drafts for its next step (fewer near
its end): that step computes its last token and the drafts (1 + K tokens, as vLLM schedules
`num_tokens_with_spec`), the sampler decides how many drafts are accepted, the rejected ones are taken back from
the computed tokens, and the request gains the accepted drafts plus one token, all in one output.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.speculation import Drafting, SpecDecodeCounters
from deepserve.simulate.tokenizer import EOS_ID, generated_token


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class TokenSink(Protocol):
    """Where a request's output goes (an HTTP stream, a test's list); called by the engine as tokens appear."""

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        """TOKEN_IDS appeared at simulated time NOW_S; FINISH_REASON ("length", "stop", "abort") on the last."""


class SimRequest:
    """One request inside the engine. Times are simulated seconds (the engine's clock)."""

    __slots__ = (
        "arrival_s",
        "block_hashes",
        "draft_tokens",
        "eos_after",
        "finish_reason",
        "first_scheduled_s",
        "first_token_s",
        "ignore_eos",
        "last_token_s",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_tokens",
        "num_preemptions",
        "num_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "scheduled_drafts",
        "sink",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        eos_after: int | None = None,
        arrival_s: float = 0.0,
        sink: TokenSink | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.eos_after = eos_after  # the simulated model's natural reply length (None: it never ends on its own)
        self.arrival_s = arrival_s
        self.sink = sink
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.num_tokens = len(prompt_token_ids)  # prompt and output so far
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1  # prompt tokens the prefix cache covered when first admitted (-1: not yet)
        self.num_preemptions = 0
        self.draft_tokens = 0  # drafts proposed for its next step (speculative decoding)
        self.scheduled_drafts = 0  # of which the step in flight verifies
        # Prompt tokens whose KV cache a connector loads instead of computing them (a decode instance of a
        # prefill/decode pair: vLLM's kv_transfer_params with do_remote_prefill): scheduled as already computed.
        self.num_external_tokens = 0
        self.finish_reason: str | None = None
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return tuple(self.prompt_token_ids[start:end])
        head = self.prompt_token_ids[start:prompt] if start < prompt else []
        return (*head, *self.output_token_ids[max(start - prompt, 0) : end - prompt])

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    def next_token(self) -> int:
        """What the simulated model samples next: its fixed text, or the end of sequence once the natural reply
        length is reached (never before min_tokens, never with ignore_eos)."""
        position = len(self.output_token_ids)
        if self.eos_after is not None and not self.ignore_eos and position + 1 >= max(self.eos_after, self.min_tokens):
            return EOS_ID
        return generated_token(position)

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, out={len(self.output_token_ids)})"
        )


def stop_reason(request: SimRequest, token: int, max_model_len: int) -> str | None:
    """Why REQUEST stops after appending TOKEN: "length" (max_tokens or the context is full), "stop" (the end of
    sequence), or None."""
    if len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    if token == EOS_ID and not request.ignore_eos:
        return "stop"
    return None


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool = True


@dataclass
class ScheduledBatch:
    """One engine step: each entry is a request and how many of its tokens this step computes."""

    entries: list[tuple[SimRequest, int, int]] = field(default_factory=list)  # request, tokens, preemptions then
    decode_tokens: int = 0  # requests computing their one newest token (and its drafts, if any)
    draft_tokens: int = 0  # drafts the decoding requests verify (speculative decoding)
    prefill_tokens: int = 0  # tokens of prompts (or of recomputed sequences), chunks included
    decode_context_tokens: int = 0  # sum of the contexts the decode tokens attend to
    prefill_positions: float = 0.0  # sum over prefill tokens of their positions (for the mean without decodes)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.entries

    @property
    def num_tokens(self) -> int:
        return self.decode_tokens + self.draft_tokens + self.prefill_tokens

    @property
    def queries_per_sequence(self) -> float:
        """Tokens each decoding request computes: its newest and the drafts it verifies (1 without drafts)."""
        return 1.0 + self.draft_tokens / self.decode_tokens if self.decode_tokens else 1.0

    @property
    def context_len(self) -> float:
        """Mean context of the decoding sequences (the step model's context_len); in a step that only prefills,
        the mean position of its prompt tokens, as the planner uses for a lone prompt (half its length)."""
        if self.decode_tokens:
            return self.decode_context_tokens / self.decode_tokens
        return self.prefill_positions / self.prefill_tokens if self.prefill_tokens else 0.0

    def add(self, request: SimRequest, tokens: int) -> None:
        self.entries.append((request, tokens, request.num_preemptions))
        start = request.num_computed_tokens
        drafts = tokens - 1
        if start == request.num_tokens - 1 and request.output_token_ids and 0 <= drafts <= request.draft_tokens:
            request.scheduled_drafts = drafts
            self.decode_tokens += 1
            self.draft_tokens += drafts
            self.decode_context_tokens += start + 1
        else:
            request.scheduled_drafts = 0
            self.prefill_tokens += tokens
            self.prefill_positions += tokens * (start + tokens / 2)


@dataclass
class SchedulerCounters:
    """Cumulative counts the metrics report (vLLM's names in comments)."""

    preemptions: int = 0  # vllm:num_preemptions_total
    prefix_queries: int = 0  # vllm:prefix_cache_queries_total: prompt tokens looked up, first admissions only
    prefix_hits: int = 0  # vllm:prefix_cache_hits_total
    prompt_tokens: int = 0  # vllm:prompt_tokens_total: whole prompts (cache hits included), at their first token
    generation_tokens: int = 0  # vllm:generation_tokens_total
    steps: int = 0


@dataclass
class StepOutput:
    request: SimRequest
    token_ids: list[int]  # one, or with speculative decoding the accepted drafts and one more
    finish_reason: str | None
    previous_token_s: float | None  # when the request's previous token appeared (None: this is its first)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, drafting: Drafting | None = None) -> None:
        if not limits.chunked_prefill and limits.max_num_batched_tokens < limits.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({limits.max_num_batched_tokens}) is smaller than max_model_len "
                f"({limits.max_model_len}) with chunked prefill off: a long prompt could never be scheduled; raise "
                "--max-num-batched-tokens, lower --max-model-len, or turn on --enable-chunked-prefill"
            )
        self.limits = limits
        self.kv = kv
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.counters = SchedulerCounters()
        self.drafting = drafting
        self.spec_counters = SpecDecodeCounters(drafting.num_tokens) if drafting else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        if request.num_prompt_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room to generate within max_model_len "
                f"{self.limits.max_model_len}"
            )
        request.status = Status.WAITING
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> bool:
        """Stop REQUEST wherever it is (a client went away); its blocks are freed. False if it had finished."""
        if request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                return False
        self.kv.free(request)
        request.status = Status.FINISHED
        request.finish_reason = "abort"
        return True

    # ---- one step ---------------------------------------------------------------------------------------------

    def schedule(self, now_s: float = 0.0) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.limits.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget, now_s)
        self.counters.steps += 1 if batch.entries else 0
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            wanted = request.num_tokens - request.num_computed_tokens
            if wanted == 1:
                wanted += request.draft_tokens  # verify its drafts with its newest token
            tokens = min(wanted, budget, self.limits.max_model_len - 1 - request.num_computed_tokens)
            if tokens <= 0:  # its tokens are in a step still in flight (pipeline parallelism)
                index += 1
                continue
            while not self.kv.allocate(request, tokens):
                victim = self.running.pop()  # the most recently admitted: FCFS preempts from the back
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    return budget
            batch.add(request, tokens)
            request.num_computed_tokens += tokens
            budget -= tokens
            index += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int, now_s: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.cached_prefix(request)
            computed = len(cached) * self.kv.block_size
            external = max(
                0, min(request.num_external_tokens, request.num_tokens - 1) - computed
            )  # loaded, not computed
            tokens = request.num_tokens - computed - external
            if not self.limits.chunked_prefill and tokens > budget:
                return
            tokens = min(tokens, budget)
            if not self.kv.allocate(request, external + tokens, cached):
                return
            self.waiting.popleft()
            if request.num_preemptions == 0 and request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
                self.counters.prefix_queries += request.num_tokens
                self.counters.prefix_hits += computed
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now_s
            request.status = Status.RUNNING
            request.num_computed_tokens = computed + external
            self.running.append(request)
            batch.add(request, tokens)
            request.num_computed_tokens += tokens
            budget -= tokens

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request)
        request.status = Status.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_tokens = request.scheduled_drafts = 0
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def update(self, batch: ScheduledBatch, now_s: float = 0.0) -> list[StepOutput]:
        """The step ran: requests that reached the end of their sequence sample (with drafts: the accepted drafts
        and one more token); some finish."""
        outputs: list[StepOutput] = []
        finished = False
        counters = self.counters
        for request, _, preemptions in batch.entries:
            if request.finished or request.num_preemptions != preemptions:
                continue  # aborted, or preempted while this step was in flight: its work was thrown away
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunk of a longer prompt: nothing to sample yet
            tokens, reason = self._sample(request)
            counters.generation_tokens += len(tokens)
            previous_s = request.last_token_s
            if request.first_token_s is None:
                request.first_token_s = now_s
                counters.prompt_tokens += request.num_prompt_tokens
            request.last_token_s = now_s
            if reason is not None:
                self._finish(request, reason)
                finished = True
            else:
                self._propose_drafts(request)
            outputs.append(StepOutput(request, tokens, reason, previous_s))
        if finished:
            self.running = [request for request in self.running if not request.finished]
        return outputs

    def _sample(self, request: SimRequest) -> tuple[list[int], str | None]:
        """The tokens REQUEST gains from its step: the accepted drafts and one more (stopping where it ends)."""
        drafts, request.scheduled_drafts, request.draft_tokens = request.scheduled_drafts, 0, 0
        accepted = 0
        if drafts and self.drafting is not None and self.spec_counters is not None:
            accepted = self.drafting.sampler.accepted(drafts)
            self.spec_counters.observe(drafts, accepted)
            request.num_computed_tokens -= drafts - accepted  # the rejected drafts' slots are recomputed later
        tokens: list[int] = []
        reason = None
        while reason is None and len(tokens) <= accepted:
            token = request.next_token()
            request.append_output(token)
            tokens.append(token)
            reason = stop_reason(request, token, self.limits.max_model_len)
        return tokens, reason

    def _propose_drafts(self, request: SimRequest) -> None:
        """K drafts for the next step: vLLM runs the drafter for every request that sampled and schedules all K
        (the step's token budget and max_model_len may cut them; a stop inside them truncates the output)."""
        if self.drafting is not None:
            request.draft_tokens = self.drafting.num_tokens

    def _finish(self, request: SimRequest, reason: str) -> None:
        self.kv.free(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
