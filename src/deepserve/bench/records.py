"""From what arrived to RequestRecords: timings relative to the run's start, output tokens and each chunk's share
of them (attribution.py says how that share is known). Requests whose server sent no usage are counted with the
tokenizer after the run (`finish_records`), so that tokenizing never competes with timing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepserve.bench.attribution import ESTIMATED, ONE_PER_CHUNK, attribute_chunk_tokens, spread_by_text
from deepserve.bench.client import DecodedStream, RawResponse, StreamingClient, decode_events
from deepserve.bench.tokenizer import TokenCounter
from deepserve.bench.types import RequestRecord


@dataclass
class UncountedOutput:
    """The text of a response without usage (nor token ids), kept for the tokenizer's count after the run."""

    text: str
    chunk_text_lens: list[int]


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
    if total is None:  # counted after the run (finish_records); until then, one token per chunk
        record.output_len = len(times)
        record.output_len_source = "tokenizer"
        record.token_attribution = ONE_PER_CHUNK
        set_chunks(record, times, [1] * len(times))
        return record, decoded
    record.output_len = total
    tokens, record.token_attribution = attribute_chunk_tokens(
        decoded.chunk_tokens, decoded.chunk_text_lens, decoded.counted_chunks, total
    )
    set_chunks(record, times, tokens)
    return record, decoded


def set_chunks(record: RequestRecord, times: list[float], tokens: list[int]) -> None:
    """Keep the chunks that carry tokens after attribution (the first one always)."""
    kept = [(t, k) for position, (t, k) in enumerate(zip(times, tokens, strict=True)) if k > 0 or position == 0]
    record.chunk_times_s = [t for t, _ in kept]
    record.chunk_tokens = [k for _, k in kept]
    record.first_token_s = record.chunk_times_s[0] if kept else None


def finish_records(
    records: list[RequestRecord], uncounted: dict[int, UncountedOutput], counter: TokenCounter | None
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
        record.output_len = counter.count(output.text) or record.output_len
        tokens = spread_by_text(record.output_len, output.chunk_text_lens)
        set_chunks(record, record.chunk_times_s, tokens)
        record.token_attribution = ESTIMATED
    return sorted(records, key=lambda record: record.index)


def output_source(records: list[RequestRecord]) -> str:
    """Where the output token counts of the completed requests came from, or "mixed" ("none": none completed)."""
    sources = {record.output_len_source for record in records if record.success}
    if not sources:
        return "none"
    return sources.pop() if len(sources) == 1 else "mixed"
