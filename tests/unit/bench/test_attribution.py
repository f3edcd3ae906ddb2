"""How each chunk's tokens are known, against hand-computed values: exact from the server's token ids, estimated by
spreading the usage total over the chunks by their text, one per chunk when nothing else is known; and the records
and ITL samples built from a vLLM-shaped stream of four tokens per chunk."""

from __future__ import annotations

import json

import pytest

from deepserve.bench.attribution import (
    ESTIMATED,
    EXACT,
    MIXED,
    ONE_PER_CHUNK,
    attribute_chunk_tokens,
    attribution_counts,
    overall_attribution,
    reconcile_chunk_tokens,
    spread_by_text,
)
from deepserve.bench.client import RawResponse
from deepserve.bench.metrics import e2el_ms, itl_ms, ttft_ms
from deepserve.bench.records import UncountedOutput, build_record, finish_records
from deepserve.bench.types import RequestRecord
from tests.helpers import present


@pytest.mark.parametrize(
    ("counts", "total", "expected"),
    [
        ([1, 1, 1], 5, [1, 1, 3]),  # shortfall goes to the last chunk
        ([1, 1, 1, 1], 2, [1, 1, 0, 0]),  # excess removed from the end
        ([3, 1], 1, [1, 0]),  # the first chunk keeps at least one token
        ([1, 2], 3, [1, 2]),
        ([], 4, []),
    ],
)
def test_reconcile_chunk_tokens(counts, total, expected):
    assert reconcile_chunk_tokens(counts, total) == expected


@pytest.mark.parametrize(
    ("total", "text_lens", "expected"),
    [
        # equal texts: equal shares
        (8, [4, 4, 4, 4], [2, 2, 2, 2]),
        # vLLM chat, 10 tokens in chunks of 1, 4, 4, 1 whose texts had 1, 3, 2, 0 characters. Weights 1, 3, 2, 1
        # (no text weighs 1) of 7: quotas 1.43, 4.29, 2.86, 1.43 → floors 1, 4, 2, 1 (8); the 2 left go to the
        # largest remainders, 0.86 (chunk 2) then 0.43 (chunk 0, the earlier of the tie with chunk 3)
        (10, [1, 3, 2, 0], [2, 4, 3, 1]),
        # three chunks without text still get one token each: quotas 0.05, 0.05, 0.05, 4.85 → 1, 1, 1, 4 is 7,
        # two too many, taken from the only chunk above one
        (5, [0, 0, 0, 100], [1, 1, 1, 2]),
        # fewer tokens than chunks: one each, the excess taken from the end
        (2, [5, 5, 5], [1, 1, 0]),
        (3, [], []),
    ],
)
def test_spread_by_text(total, text_lens, expected):
    assert spread_by_text(total, text_lens) == expected
    if text_lens and total >= len(text_lens):
        assert sum(expected) == total and min(expected) >= 1


def test_attribution_says_how_the_counts_are_known():
    assert attribute_chunk_tokens([1, 4, 4, 1], [1, 3, 2, 0], 4, 10) == ([1, 4, 4, 1], EXACT)  # listed, agreeing
    assert attribute_chunk_tokens([1, 1, 1], [2, 2, 2], 0, 3) == ([1, 1, 1], EXACT)  # one each, as the total says
    assert attribute_chunk_tokens([1, 1, 1, 1], [1, 3, 2, 0], 0, 10) == ([2, 4, 3, 1], ESTIMATED)
    assert attribute_chunk_tokens([2, 2], [1, 1], 2, 5) == ([2, 3], ESTIMATED)  # listed, but the total says more


def test_the_run_reports_one_attribution_or_mixed():
    def done(kind: str) -> RequestRecord:
        return RequestRecord(0, 1, 0.0, 0.0, token_attribution=kind)

    failed = RequestRecord(0, 1, 0.0, 0.0, error="HTTP 500", token_attribution=ONE_PER_CHUNK)
    assert overall_attribution([done(EXACT), done(EXACT), failed]) == EXACT
    assert overall_attribution([done(EXACT), done(ESTIMATED), done(ESTIMATED)]) == MIXED
    assert attribution_counts([done(EXACT), done(ESTIMATED), done(ESTIMATED), failed]) == {ESTIMATED: 2, EXACT: 1}
    assert overall_attribution([failed]) == EXACT  # nothing completed: nothing estimated


def vllm_stream(with_ids: bool, usage: bool = True) -> RawResponse:
    """vLLM 0.32 on chat with --stream-interval 4, 10 tokens: the role chunk, then 1, 4, 4 and 1 tokens, arriving
    at 1.000, 1.040, 1.080, 1.090 s; the usage chunk and [DONE] at 1.091 s."""
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    texts, ids = ["r", "x~!", "yz", ""], [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    events: list[dict] = [role]
    for text, token_ids in zip(texts, ids, strict=True):
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None, "token_ids": None}
        if with_ids:
            choice["token_ids"] = token_ids
        events.append({"choices": [choice]})
    times = [0.99, 1.0, 1.04, 1.08, 1.09]
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 10}})
        times.append(1.091)
    payloads = [json.dumps(event).encode() for event in events] + [b"[DONE]"]
    return RawResponse(200, payloads, [*times, 1.091], end_s=1.091)


def test_exact_counts_give_per_token_itl_that_sums_to_the_decode_time():
    record, _ = build_record(0, 8, 0.0, 0.9, vllm_stream(with_ids=True), t0=0.0)
    assert record.token_attribution == EXACT and record.output_len_source == "usage"
    assert record.chunk_tokens == [1, 4, 4, 1]
    # 40 ms for 4 tokens, 40 ms for 4, 10 ms for 1: four samples of 10, four of 10, one of 10
    assert itl_ms(record) == pytest.approx([10.0] * 9)
    decode_ms = present(e2el_ms(record)) - present(
        ttft_ms(record)
    )  # 191 − 100 = 91: the response ended 1 ms after the last token
    assert sum(itl_ms(record)) == pytest.approx(90.0) and decode_ms == pytest.approx(91.0)


def test_without_ids_the_usage_total_is_spread_by_text():
    record, _ = build_record(0, 8, 0.0, 0.9, vllm_stream(with_ids=False), t0=0.0)
    assert record.token_attribution == ESTIMATED
    # text lengths 1, 3, 2, 0 → weights 1, 3, 2, 1 of 7: quotas 1.43, 4.29, 2.86, 1.43 → floors 1, 4, 2, 1 (8),
    # then +1 to chunk 2 (remainder 0.86) and chunk 0 (0.43, before chunk 3's equal 0.43)
    assert record.chunk_tokens == [2, 4, 3, 1]
    assert len(itl_ms(record)) == 9  # one sample per token after the first, as with exact counts
    # the first chunk's second token arrived with it (0), then 40 ms over 4, 40 ms over 3, 10 ms over 1
    assert itl_ms(record) == pytest.approx([0.0, 10.0, 10.0, 10.0, 10.0, 40 / 3, 40 / 3, 40 / 3, 10.0])
    assert sum(itl_ms(record)) == pytest.approx(90.0)


def test_without_usage_the_tokenizer_count_is_spread_after_the_run():
    class CharCounter:
        source = "chars"

        def count(self, text: str) -> int:
            return len(text) + 4  # whatever it says is the total

    record, decoded = build_record(0, 8, 0.0, 0.9, vllm_stream(with_ids=False, usage=False), t0=0.0)
    assert (record.output_len_source, record.token_attribution) == ("tokenizer", ONE_PER_CHUNK)
    uncounted = {0: UncountedOutput(decoded.text, decoded.chunk_text_lens)}
    [counted] = finish_records([record], uncounted, CharCounter())
    assert counted.output_len == 10 and counted.token_attribution == ESTIMATED
    assert counted.chunk_tokens == [2, 4, 3, 1]
    alone, _ = build_record(0, 8, 0.0, 0.9, vllm_stream(with_ids=False, usage=False), t0=0.0)
    [kept] = finish_records([alone], {}, None)
    assert (kept.output_len_source, kept.token_attribution, kept.chunk_tokens) == ("chunks", ONE_PER_CHUNK, [1] * 4)


def test_without_usage_token_ids_give_the_total():
    record, _ = build_record(0, 8, 0.0, 0.9, vllm_stream(with_ids=True, usage=False), t0=0.0)
    assert (record.output_len, record.output_len_source, record.token_attribution) == (10, "token_ids", EXACT)
