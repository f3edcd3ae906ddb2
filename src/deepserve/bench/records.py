"""From what arrived to RequestRecords: timings relative to the run's start, output tokens and each chunk's share
of them (attribution.py says how that share is known). Requests whose server sent no usage are counted with the
tokenizer after the run (`finish_records`), so that tokenizing never competes with timing."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from deepserve.bench.attribution import ESTIMATED, ONE_PER_CHUNK, attribute_chunk_tokens, spread_by_text
from deepserve.bench.client import DecodedStream, RawResponse, StreamingClient, decode_events
from deepserve.bench.phases import set_phases
from deepserve.bench.types import RequestRecord


@dataclass
class UncountedOutput:
    """The text of a response without usage (nor token ids), kept for the tokenizer's count after the run, with
    what its chunks carried (phases.py)."""

    text: str
    chunk_text_lens: list[int]
    phases: Phases | None = None
    other_text: str = ""  # reasoning and tool-call text, counted on its own (a join could merge tokens)


@dataclass
class Phases:
    """What a stream's token chunks carried (kinds per chunk, as phases.py's flags) and what it said about them."""

    kinds: list[int]
    reasoning_share: dict[int, float]
    usage_reasoning: int | None
    tool_calls: int
    finish_s: float | None  # relative to the run

    @classmethod
    def of(cls, decoded: DecodedStream, t0: float) -> Phases | None:
        if not decoded.chunk_kinds and decoded.usage_reasoning_tokens is None:
            return None
        finish_s = None if decoded.finish_s is None else decoded.finish_s - t0
        return cls(
            decoded.chunk_kinds,
            decoded.reasoning_share,
            decoded.usage_reasoning_tokens,
            len(decoded.tool_calls),
            finish_s,
        )


async def send_safely(
    client: StreamingClient, wire: bytes, not_after: float | None = None
) -> tuple[float, RawResponse] | None:
    """`client.send`, with a client bug turned into a failed response: it must not end the run. None: not sent,
    its connection was ready only after NOT_AFTER (the end of a duration-bound run)."""
    try:
        return await client.send(wire, not_after)
    except Exception as exc:
        now = time.perf_counter()
        return now, RawResponse(error=f"client error: {exc.__class__.__name__}: {exc}", end_s=now)


def record_of(
    index: int, prompt_len: int, scheduled_s: float, sent_abs: float, response: RawResponse, t0: float
) -> tuple[RequestRecord, DecodedStream]:
    """`build_record`, with a response it cannot decode turned into a failed record."""
    try:
        return build_record(index, prompt_len, scheduled_s, sent_abs, response, t0)
    except Exception as exc:
        error = f"undecodable response: {exc.__class__.__name__}: {exc}"
        return RequestRecord(index, prompt_len, scheduled_s, sent_abs - t0, error=error), DecodedStream()


def build_record(
    index: int, prompt_len: int, scheduled_s: float, sent_abs: float, response: RawResponse, t0: float
) -> tuple[RequestRecord, DecodedStream]:
    """The record of a finished raw response (times relative to T0) and the decoded stream it came from."""
    decoded = decode_events(response)
    record = RequestRecord(
        index=index,
        prompt_len=decoded.usage_prompt_tokens or prompt_len,
        scheduled_s=scheduled_s,
        sent_s=sent_abs - t0,
        end_s=None if response.end_s is None else response.end_s - t0,
        status_code=response.status or None,
        error=decoded.error,
    )
    times = [arrived - t0 for arrived in decoded.chunk_times]
    total = decoded.usage_completion_tokens
    if total is None and decoded.all_chunks_counted:
        total = sum(decoded.chunk_tokens)  # no usage, but every chunk listed its tokens
        record.output_len_source = "token_ids"
    phases = Phases.of(decoded, t0)
    if total is None:  # counted after the run (finish_records); until then, one token per chunk
        record.output_len = len(times)
        record.output_len_source = "tokenizer"
        record.token_attribution = ONE_PER_CHUNK
        set_chunks(record, times, [1] * len(times), phases)
        return record, decoded
    record.output_len = total
    tokens, record.token_attribution = attribute_chunk_tokens(
        decoded.chunk_tokens, decoded.chunk_text_lens, decoded.counted_chunks, total
    )
    set_chunks(record, times, tokens, phases)
    return record, decoded


def set_chunks(record: RequestRecord, times: list[float], tokens: list[int], phases: Phases | None = None) -> None:
    """Keep the chunks that carry tokens after attribution (the first one always), and what they carried."""
    kept = [position for position, k in enumerate(tokens) if k > 0 or position == 0]
    record.chunk_times_s = [times[position] for position in kept]
    record.chunk_tokens = [tokens[position] for position in kept]
    record.first_token_s = record.chunk_times_s[0] if kept else None
    if phases is None:
        return
    kinds = [phases.kinds[position] for position in kept] if phases.kinds else []
    moved = {new: phases.reasoning_share[old] for new, old in enumerate(kept) if old in phases.reasoning_share}
    set_phases(record, kinds, moved, phases.usage_reasoning, phases.tool_calls, phases.finish_s)


class TextCounter(Protocol):
    """What counting a reply's tokens needs of a tokenizer (a TokenCounter is one)."""

    def count(self, text: str) -> int: ...


def finish_records(
    records: list[RequestRecord], uncounted: dict[int, UncountedOutput], counter: TextCounter | None
) -> list[RequestRecord]:
    """Count the output of requests whose server sent no usage with the tokenizer and spread it over their chunks
    by text; without a tokenizer they keep one token per chunk. Returns the records in index order."""
    for record in records:
        if record.output_len_source != "tokenizer":
            continue
        output = uncounted.get(record.index)
        if counter is None or output is None or not record.success:
            record.output_len_source = "chunks"
            continue
        counted = counter.count(output.text) + (counter.count(output.other_text) if output.other_text else 0)
        record.output_len = counted or record.output_len
        tokens = spread_by_text(record.output_len, output.chunk_text_lens)
        set_chunks(record, record.chunk_times_s, tokens, output.phases)
        record.token_attribution = ESTIMATED
    return sorted(records, key=lambda record: record.index)


def output_source(records: list[RequestRecord]) -> str:
    """Where the output token counts of the completed requests came from, or "mixed" ("none": none completed)."""
    sources = {record.output_len_source for record in records if record.success}
    if not sources:
        return "none"
    return sources.pop() if len(sources) == 1 else "mixed"
