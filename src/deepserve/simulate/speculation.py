"""Speculative decoding in the simulated engine: how many of a step's drafts the target model accepts.

Drafts are verified in order and the first rejection ends the run (vLLM's rejection sampler): draft i is accepted
with probability alpha_i given drafts 1..i-1 were, so that over many steps the fraction of drafts whose first i
tokens were all accepted is r_i = prod_{j<=i} alpha_j, the per-position rate vLLM reports
(vllm:spec_decode_num_accepted_tokens_per_pos_total{position} / vllm:spec_decode_num_drafts_total). The random
source is injected (a seeded `random.Random` by default), so a run is reproducible and tests can pin outcomes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise


class AcceptanceSampler:
    """Accepted drafts per verification, from per-position rates r_1 >= r_2 >= ... (vLLM's convention)."""

    def __init__(self, acceptance: Sequence[float], rng: random.Random | None = None, seed: int = 0) -> None:
        if any(later > earlier for earlier, later in pairwise(acceptance)):
            raise ValueError(f"per-position acceptance must not increase: {list(acceptance)}")
        self.acceptance = tuple(acceptance)
        self.rng = rng or random.Random(seed)
        previous = 1.0
        self.conditional: list[float] = []
        for rate in self.acceptance:
            self.conditional.append(rate / previous if previous > 0 else 0.0)
            previous = rate

    def accepted(self, drafts: int) -> int:
        """How many of DRAFTS drafts (the first ones, in order) the target model accepts in one step."""
        for position in range(drafts):
            alpha = self.conditional[position] if position < len(self.conditional) else 0.0
            if alpha < 1.0 and self.rng.random() >= alpha:
                return position
        return drafts


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py, SpecDecodingStats.observe_draft)."""

    num_tokens: int  # K: the per-position series run over positions 0..K-1
    drafts: int = 0  # verifications of a request's drafts (vllm:spec_decode_num_drafts_total)
    draft_tokens: int = 0  # vllm:spec_decode_num_draft_tokens_total
    accepted_tokens: int = 0  # vllm:spec_decode_num_accepted_tokens_total
    accepted_per_position: list[int] = field(default_factory=list)  # ..._per_pos_total{position}

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_tokens

    def observe(self, drafts: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1


@dataclass(frozen=True)
class Drafting:
    """The scheduler's speculative decoding: K drafts proposed after every sampled token, judged by SAMPLER."""

    num_tokens: int
    sampler: AcceptanceSampler
