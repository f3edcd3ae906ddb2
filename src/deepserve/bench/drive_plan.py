"""The run, encoded before it starts: every request as the bytes of one socket write (`PreparedRequest`), and what a
driver needs to release them (`DrivePlan`, picklable for worker processes)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from deepserve.bench.arrivals import RateRamp
from deepserve.bench.client import Endpoint, build_payload, build_request_bytes
from deepserve.bench.config import BenchConfig, TargetConfig
from deepserve.bench.conversations import PreparedConversation
from deepserve.bench.token_ids import FIELD as TOKEN_IDS_FIELD
from deepserve.bench.types import ConversationSpec, RequestSpec
from deepserve.bench.workloads import Workload

ID_HEADER_PREFIX = b"x-request-id:"  # lower case: header names are compared case-insensitively
WARM_UP_MARK = "Warm-up {number}. "


@dataclass
class PreparedRequest:
    """A request encoded once before the run, so that sending it is one socket write."""

    spec_index: int
    prompt_len: int
    wire: bytes
    request_id: str = ""  # sent as x-request-id (vLLM's --request-id-prefix + index), kept in the record
    session: int | None = None  # an agent trace's session and the request's place in it (the record's turn)
    turn: int | None = None

    def renamed(self, request_id: str) -> PreparedRequest:
        """The same request under another id: a duration-bound run that goes through the workload again must not
        send an id twice (engines key their request state by it). Raises ValueError unless the request carries its
        id header exactly once (a request sent under a stale id would corrupt the run silently)."""
        head, blank, body = self.wire.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        at = [i for i, line in enumerate(lines) if line.lower().startswith(ID_HEADER_PREFIX)]
        expected = f"x-request-id: {self.request_id}".encode()
        if len(at) != 1 or lines[at[0]] != expected:
            found = [line.decode(errors="replace") for line in lines if line.lower().startswith(ID_HEADER_PREFIX)]
            raise ValueError(
                f"cannot rename request {self.spec_index} to {request_id!r}: expected the header "
                f"{expected.decode()!r} exactly once, found {found or 'none'}"
            )
        lines[at[0]] = f"x-request-id: {request_id}".encode()
        wire = b"\r\n".join(lines) + blank + body
        return PreparedRequest(self.spec_index, self.prompt_len, wire, request_id, self.session, self.turn)


@dataclass
class DrivePlan:
    """Everything one driver (the main process, or one worker) needs; picklable for worker processes."""

    endpoint: Endpoint
    requests: list[PreparedRequest]
    warmups: list[PreparedRequest]
    num_requests: int | None  # None: until duration_s
    request_rate: float
    burstiness: float
    seed: int
    max_concurrency: int | None
    ramp_up_s: float | None
    duration_s: float | None
    request_timeout_s: float
    index_offset: int = 0  # worker w sends indices w, w + W, …
    index_stride: int = 1
    request_id_prefix: str = ""  # ids of requests sent again in a duration-bound run: this prefix + their index
    rate_ramp: RateRamp | None = None  # vLLM's --ramp-up-strategy: replaces request_rate for the first batch
    verify_tls: bool = True
    schedule_s: list[float] | None = None  # a replayed trace's release times, one per request (replaces the rate)
    conversations: list[PreparedConversation] = field(default_factory=list)  # multi-turn: sent instead of requests
    chat: bool = False  # the endpoint takes messages (conversations build their bodies during the run)
    turn_slots: int = 1  # record indices each conversation owns: conversation c's turn t (from 0) is c * slots + t

    @property
    def units(self) -> int:
        """What the dispatcher releases: requests, or conversations (each holds one concurrency slot throughout)."""
        return len(self.conversations) or len(self.requests)

    @property
    def expected_records(self) -> int | None:
        """Records a complete run makes (None: until duration_s)."""
        if self.num_requests is None:
            return None
        if self.conversations:
            return sum(len(conversation.spec.turns) for conversation in self.conversations)
        return self.num_requests


def request_id_prefix(target: TargetConfig) -> str:
    """--request-id-prefix, else vLLM's default shape: bench-<8 hex digits>-."""
    return target.request_id_prefix if target.request_id_prefix is not None else f"bench-{uuid.uuid4().hex[:8]}-"


def make_drive_plan(
    config: BenchConfig, model: str, workload: Workload, prefix: str, token_ids: bool = False
) -> DrivePlan:
    """Everything encoded before the run. TOKEN_IDS: every request asks for its chunks' token ids."""
    target, load = config.target, config.load
    endpoint = Endpoint.from_url(target.url)
    headers = target.request_headers()
    extras = target.body_extras() | ({TOKEN_IDS_FIELD: True} if token_ids else {})
    specs = workload.requests
    models = target.request_models(model, max(len(specs), len(workload.conversations)), config.workload.seed)

    def prepare(position: int, spec: RequestSpec, request_id: str) -> PreparedRequest:
        payload = build_payload(spec, models[position % len(models)], target.chat, extras)
        wire = build_request_bytes(endpoint, payload, headers, request_id)
        return PreparedRequest(position, spec.prompt_len, wire, request_id, spec.session, spec.turn)

    def converse_with(position: int, conversation: ConversationSpec) -> PreparedConversation:
        payload = {"model": models[position], "stream": True, "stream_options": {"include_usage": True}, **extras}
        return PreparedConversation(conversation, payload, headers)

    requests = [prepare(i, spec, f"{prefix}{i}") for i, spec in enumerate(specs)]
    conversations = [converse_with(i, conversation) for i, conversation in enumerate(workload.conversations)]
    warmup_specs = specs or [first_turn_request(conversation) for conversation in workload.conversations]
    warmups = [
        prepare(i, warm_up_variant(warmup_specs[i % len(warmup_specs)], i), f"{prefix}warmup-{i}")
        for i in range(load.num_warmups)
    ]
    schedule = [spec.arrival_s for spec in specs] if specs and workload.self_timed else None
    units = len(conversations) or len(requests)
    return DrivePlan(
        endpoint=endpoint,
        requests=requests,
        warmups=warmups,
        conversations=conversations,
        chat=target.chat,
        turn_slots=max((len(conversation.turns) for conversation in workload.conversations), default=1),
        schedule_s=[0.0 if at is None else at for at in schedule] if schedule is not None else None,
        num_requests=None if load.duration_s is not None else units,
        request_rate=load.request_rate,
        burstiness=load.burstiness,
        seed=config.workload.seed,
        max_concurrency=load.max_concurrency,
        ramp_up_s=load.ramp_up_s,
        duration_s=load.duration_s,
        request_timeout_s=target.request_timeout_s,
        rate_ramp=load.rate_ramp(),
        verify_tls=not target.insecure,
        request_id_prefix=prefix,
    )


def first_turn_request(conversation: ConversationSpec) -> RequestSpec:
    """A conversation's first turn as a plain request (the warm-ups of a multi-turn run)."""
    turn = conversation.turns[0]
    min_len = turn.output_len if conversation.exact_output_len else None
    return RequestSpec(
        conversation.index, turn.user_text, turn.user_len, turn.output_len, min_len, conversation.ignore_eos
    )


def warm_up_variant(spec: RequestSpec, number: int) -> RequestSpec:
    """SPEC as warm-up request NUMBER sends it: its prompt led by a mark of its own. A warm-up reuses the workload's
    first requests, and an engine with a prefix cache (vLLM's default) would otherwise serve those measured requests
    from the blocks the warm-up left, their prompts all but computed: a TTFT the workload does not have. The mark
    goes first because a prefix cache matches from the first token; a first message that is not plain text
    (parts, tool calls) is left as it is."""
    mark = WARM_UP_MARK.format(number=number)
    if isinstance(spec.prompt, str):
        return replace(spec, prompt=mark + spec.prompt)
    if spec.prompt and isinstance(spec.prompt[0].get("content"), str):
        first = {**spec.prompt[0], "content": mark + spec.prompt[0]["content"]}
        return replace(spec, prompt=[first, *spec.prompt[1:]])
    return spec
