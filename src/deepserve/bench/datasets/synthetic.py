"""Synthetic datasets: random text of exact token counts. Every length is in server tokens (see `tokenizer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepserve.bench.datasets.base import (
    DatasetContext,
    DatasetResult,
    DraftRequest,
    draw_uniform_ints,
    output_bounds,
    range_bounds,
)
from deepserve.bench.datasets.text import render_prompt
from deepserve.errors import ConfigError

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig


def _draft(ctx: DatasetContext, text: str, prompt_len: int, output_len: int | None = None) -> DraftRequest:
    """TEXT was built to measure exactly PROMPT_LEN tokens (PromptBuilder.build checks it)."""
    return DraftRequest(render_prompt(text, ctx.chat), prompt_len, output_len)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _output_lens(config: WorkloadConfig, rng: np.random.Generator, n: int) -> list[int]:
    low, high = output_bounds(config.random_output_len, config.range_ratios()[1])
    return draw_uniform_ints(rng, low, high, n)


class RandomDataset:
    """vLLM's `random`: input length uniform in random_input_len ± ratio (the BOS included, as vLLM counts it),
    plus an optional prefix of random_prefix_len tokens shared by every request."""

    name = "random"
    default_num_prompts = 1000
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        input_ratio, _ = config.range_ratios()
        special = ctx.special_tokens()
        # vLLM draws the length of the text after the special tokens, then the server adds them back
        low, high = range_bounds(max(0, config.random_input_len - special), input_ratio)
        if config.random_prefix_len + low < 1:
            raise ConfigError(
                f"--random-input-len {config.random_input_len} leaves no tokens after the {special} special "
                "token(s) at this range ratio; ask for a longer input"
            )
        rng = ctx.rng("lengths")
        input_lens = draw_uniform_ints(rng, low, high, num_prompts)
        output_lens = _output_lens(config, rng, num_prompts)
        header, _ = ctx.builder.template_split()
        prefix_rng = ctx.rng("prefix")
        head = ctx.builder.prefix(header + config.random_prefix_len, prefix_rng) if config.random_prefix_len else ""
        targets = [config.random_prefix_len + length + special for length in input_lens]
        texts = ctx.build_texts(targets, [head] * len(targets))
        requests = [_draft(ctx, *args) for args in zip(texts, targets, output_lens, strict=True)]
        return DatasetResult(
            requests,
            {
                "input_len_range": [
                    low + special + config.random_prefix_len,
                    high + special + config.random_prefix_len,
                ],
                "output_len_range": list(output_bounds(config.random_output_len, config.range_ratios()[1])),
                "special_tokens": special,
            },
        )


class LongDataset:
    """One long prompt (the seeds used 10K and 16K tokens): each request gets its own text of exactly
    long_prompt_len tokens, so a prefix cache cannot shorten the prefill of the next one."""

    name = "long"
    default_num_prompts = 1
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        output_lens = _output_lens(config, ctx.rng("lengths"), num_prompts)
        targets = [config.long_prompt_len] * num_prompts
        texts = ctx.build_texts(targets)
        requests = [_draft(ctx, *args) for args in zip(texts, targets, output_lens, strict=True)]
        return DatasetResult(requests, {"input_len": config.long_prompt_len})


class SampledDataset:
    """N requests with input lengths uniform in [sampled_min_input_len, sampled_max_input_len] (a seed used 200
    requests of 100 to 32K tokens)."""

    name = "sampled"
    default_num_prompts = 200
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        low, high = config.sampled_min_input_len, config.sampled_max_input_len
        rng = ctx.rng("lengths")
        input_lens = draw_uniform_ints(rng, low, high, num_prompts)
        output_lens = _output_lens(config, rng, num_prompts)
        texts = ctx.build_texts(input_lens)
        requests = [_draft(ctx, *args) for args in zip(texts, input_lens, output_lens, strict=True)]
        return DatasetResult(requests, {"input_len_range": [low, high]})


def _grouped_prompts(
    ctx: DatasetContext, shared_tokens: int, num_groups: int, groups: list[int], totals: list[int]
) -> tuple[list[str], int | None]:
    """Texts for requests in GROUPS (group index per request) with TOTALS tokens each; requests of a group share
    their first SHARED_TOKENS tokens. Returns the texts and the shared tokens measured on group 0."""
    heads = [ctx.builder.prefix(shared_tokens, ctx.rng(f"prefix/{g}")) for g in range(num_groups)]
    texts = ctx.build_texts(totals, [heads[g] for g in groups])
    first_two = [i for i, g in enumerate(groups) if g == groups[0]][:2] if groups else []
    measured = None
    if len(first_two) == 2:
        a, b = (render_prompt(texts[i], ctx.chat) for i in first_two)
        measured = _common_prefix_len(ctx.counter.prompt_ids(a), ctx.counter.prompt_ids(b))
    return texts, measured


class SharedPrefixDataset:
    """Groups of requests that share a prefix: shared_prefix_len tokens, or shared_prefix_fraction of
    random_input_len (a seed shared 2,000 of 3,200 tokens). Total lengths follow random_input_len ± ratio;
    requests take the groups in turn (0, 1, …, 0, 1, …), as interleaved users would."""

    name = "shared_prefix"
    default_num_prompts = 1000
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        shared = config.resolved_shared_prefix_len()
        low, high = range_bounds(config.random_input_len, config.range_ratios()[0])
        if shared >= low:
            raise ConfigError(
                f"a shared prefix of {shared} tokens leaves nothing of its own to requests as short as {low} "
                "tokens; lower --shared-prefix-len/--shared-prefix-fraction or raise --random-input-len"
            )
        rng = ctx.rng("lengths")
        totals = draw_uniform_ints(rng, low, high, num_prompts)
        output_lens = _output_lens(config, rng, num_prompts)
        groups = [i % config.num_prefix_groups for i in range(num_prompts)]
        texts, measured = _grouped_prompts(ctx, shared, config.num_prefix_groups, groups, totals)
        requests = [_draft(ctx, text, total, out) for text, total, out in zip(texts, totals, output_lens, strict=True)]
        details = {"shared_prefix_len": shared, "input_len_range": [low, high], "measured_shared_tokens": measured}
        return DatasetResult(requests, details)


class PrefixRepetitionDataset:
    """vLLM's `prefix_repetition`: prefix_repetition_num_prefixes prefixes of prefix_repetition_prefix_len tokens,
    each followed by num_prompts // num_prefixes different suffixes of prefix_repetition_suffix_len tokens, then
    shuffled (unless --disable-shuffle). Unlike vLLM, the BOS is counted inside the prefix (server tokens)."""

    name = "prefix_repetition"
    default_num_prompts = 1000
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        num_prefixes = config.prefix_repetition_num_prefixes
        per_prefix = num_prompts // num_prefixes
        if per_prefix == 0:
            raise ConfigError(
                f"--num-prompts {num_prompts} must be at least --prefix-repetition-num-prefixes {num_prefixes}"
            )
        groups = [g for g in range(num_prefixes) for _ in range(per_prefix)]
        total = config.prefix_repetition_prefix_len + config.prefix_repetition_suffix_len
        texts, measured = _grouped_prompts(
            ctx, config.prefix_repetition_prefix_len, num_prefixes, groups, [total] * len(groups)
        )
        requests = [_draft(ctx, text, total, config.prefix_repetition_output_len) for text in texts]
        if not config.disable_shuffle:
            order = ctx.rng("shuffle").permutation(len(requests))
            requests = [requests[i] for i in order]
        details = {"prompts_per_prefix": per_prefix, "input_len": total, "measured_shared_tokens": measured}
        return DatasetResult(requests, details)
