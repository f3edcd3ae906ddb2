"""How many output tokens each streamed chunk carried: the per-chunk counts that ITL and peak tokens/s rest on.

A chunk may carry several tokens (speculative decoding, MTP, vLLM's --stream-interval). Three cases, named in
each record's `token_attribution` (docs/METRICS.md, "Tokens per chunk"):

- exact: the server listed each chunk's tokens (vLLM's `token_ids` with return_token_ids, or logprobs) and they
  add up to its total; or the total equals the number of token chunks, so each carried exactly one.
- estimated: only the total is known (usage, or the tokenizer's count of the text): it is spread over the token
  chunks in proportion to the text each carried, at least one token each (`spread_by_text`).
- one-per-chunk: no total at all (no usage, no tokenizer): each token chunk counts as one token.
"""

from __future__ import annotations

from collections import Counter

from deepserve.bench.types import RequestRecord

EXACT = "exact"
ESTIMATED = "estimated"
ONE_PER_CHUNK = "one-per-chunk"
MIXED = "mixed"


def reconcile_chunk_tokens(chunk_tokens: list[int], total: int) -> list[int]:
    """Make the per-chunk counts add up to the server's total: add a shortfall to the last chunk; take an excess
    away from the last chunks backwards (a chunk may drop to zero, except the first, which keeps one)."""
    counts = list(chunk_tokens)
    if not counts or total <= 0:
        return counts
    diff = total - sum(counts)
    if diff > 0:
        counts[-1] += diff
    index = len(counts) - 1
    while diff < 0 and index >= 0:
        floor = 1 if index == 0 else 0
        take = min(counts[index] - floor, -diff)
        counts[index] -= take
        diff += take
        index -= 1
    return counts


def spread_by_text(total: int, text_lens: list[int]) -> list[int]:
    """TOTAL tokens spread over chunks in proportion to their text lengths (a chunk without text weighs as one
    character), at least one token each, by largest remainders; ties go to the earlier chunk. With fewer tokens
    than chunks, each gets one and the excess is taken from the last ones (`reconcile_chunk_tokens`)."""
    n = len(text_lens)
    if n == 0 or total <= n:
        return reconcile_chunk_tokens([1] * n, total)
    weights = [max(length, 1) for length in text_lens]
    weight_sum = sum(weights)
    quotas = [total * weight / weight_sum for weight in weights]
    counts = [max(1, int(quota)) for quota in quotas]
    diff = total - sum(counts)
    while diff != 0:  # |diff| < n: one pass over the chunks ordered by what they lack (or have too much)
        if diff > 0:
            order = sorted(range(n), key=lambda i: (counts[i] - quotas[i], i))
        else:
            order = sorted((i for i in range(n) if counts[i] > 1), key=lambda i: (quotas[i] - counts[i], i))
        for i in order[: abs(diff)]:
            counts[i] += 1 if diff > 0 else -1
        diff = total - sum(counts)
    return counts


def attribute_chunk_tokens(
    counts: list[int], text_lens: list[int], counted_chunks: int, total: int
) -> tuple[list[int], str]:
    """(tokens of each chunk, attribution) given the chunks' own COUNTS (of which COUNTED_CHUNKS came from the
    server's token ids or logprobs, the others are 1), their TEXT_LENS and the server's TOTAL."""
    if not counts:
        return counts, EXACT
    if counted_chunks == len(counts) and sum(counts) == total:
        return counts, EXACT
    if counted_chunks == 0 and total == len(counts):
        return counts, EXACT  # one token per chunk, and the total says so
    if counted_chunks == len(counts):  # listed, but they disagree with the total: trust the total
        return reconcile_chunk_tokens(counts, total), ESTIMATED
    return spread_by_text(total, text_lens), ESTIMATED


def attribution_counts(records: list[RequestRecord]) -> dict[str, int]:
    """Completed requests per attribution, most frequent first."""
    return dict(Counter(record.token_attribution for record in records if record.success).most_common())


def overall_attribution(records: list[RequestRecord]) -> str:
    """The attribution of every completed request, or "mixed" (or "exact" when none completed)."""
    kinds = attribution_counts(records)
    if not kinds:
        return EXACT
    return next(iter(kinds)) if len(kinds) == 1 else MIXED
