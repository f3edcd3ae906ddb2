"""Synthetic multi-turn conversations: a first prompt of exact length, then user turns of exact length, each
answered before the next is sent (bench/conversations.py runs them). --num-prompts counts conversations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepserve.bench.datasets.base import (
    DatasetContext,
    DatasetResult,
    draw_uniform_ints,
    output_bounds,
    range_bounds,
)
from deepserve.bench.types import ConversationSpec, TurnSpec
from deepserve.errors import ConfigError

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig


def think_times_s(rng: np.random.Generator, mean_s: float, ratio: float, n: int) -> list[float]:
    """N think times uniform in [mean·(1−ratio), mean·(1+ratio)] (all MEAN_S when RATIO is 0)."""
    if n == 0 or mean_s == 0:
        return [0.0] * n
    return [float(x) for x in rng.uniform(mean_s * (1 - ratio), mean_s * (1 + ratio), size=n)]


class MultiTurnDataset:
    """Conversations of --multi-turn-num-turns turns. The first turn's prompt is --random-input-len server tokens
    (± the input range ratio); every later turn adds a user message of --multi-turn-input-len text tokens (same
    ratio) to the history; each answer is --random-output-len tokens (± the output ratio, or --min/--max-output-len);
    before each later turn the user thinks for --multi-turn-think-time-s (± --multi-turn-think-time-ratio)."""

    name = "multi_turn"
    default_num_prompts = 100  # conversations
    replays_trace = False

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        turns = config.multi_turn_num_turns
        later = num_prompts * (turns - 1)
        input_ratio, output_ratio = config.range_ratios()
        rng = ctx.rng("lengths")
        first_lens = draw_uniform_ints(rng, *range_bounds(config.random_input_len, input_ratio), num_prompts)
        user_lens = draw_uniform_ints(rng, *_positive(range_bounds(config.multi_turn_input_len, input_ratio)), later)
        if config.min_output_len is not None and config.max_output_len is not None:
            out_bounds = (config.min_output_len, config.max_output_len)
        else:
            out_bounds = output_bounds(config.random_output_len, output_ratio)
        output_lens = draw_uniform_ints(rng, *out_bounds, num_prompts * turns)
        thinks = think_times_s(
            ctx.rng("think"), config.multi_turn_think_time_s, config.multi_turn_think_time_ratio, later
        )
        first_texts = ctx.build_texts(first_lens, stream="text")
        header, trailer = ctx.builder.template_split()
        # a later turn's text is measured alone, inside the template: header + text + trailer tokens
        user_texts = ctx.build_texts([n + header + trailer for n in user_lens], stream="turn")
        conversations = []
        for c in range(num_prompts):
            specs = [TurnSpec(first_texts[c], first_lens[c], output_lens[c * turns])]
            for t in range(1, turns):
                k = c * (turns - 1) + t - 1
                specs.append(TurnSpec(user_texts[k], user_lens[k], output_lens[c * turns + t], thinks[k]))
            conversations.append(ConversationSpec(c, tuple(specs), config.sends_ignore_eos, config.exact_output_len))
        details = {
            "conversations": num_prompts,
            "turns_per_conversation": turns,
            "first_input_len_range": list(range_bounds(config.random_input_len, input_ratio)),
            "turn_input_len_range": list(_positive(range_bounds(config.multi_turn_input_len, input_ratio))),
            "output_len_range": list(out_bounds),
            "think_time_s": config.multi_turn_think_time_s,
        }
        return DatasetResult([], details, conversations)


def _positive(bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    if high < 1:
        raise ConfigError("--multi-turn-input-len leaves no tokens at this range ratio; ask for a longer input")
    return max(low, 1), high
