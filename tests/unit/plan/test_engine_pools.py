from __future__ import annotations

import pytest

from deepserve.models import load_spec
from deepserve.plan.engine_pools import sglang_v4_pool
from deepserve.plan.planner import make_plan
from deepserve.plan.types import PlanConfig

GIB = 1024**3
FLASH, PRO = "deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro"


def test_sglang_v4_bytes_per_token_by_hand() -> None:
    """DSV4PoolConfigurator._get_bytes_per_full_token (sglang 0.5.15) for V4-Flash (43 layers: 21 CSA, 20 HCA):
    an entry is 448 + 2 x 64 + 8 = 584 B, an indexer key 128 + 4 B; the SWA pool holds every layer's entry and the
    CSA layers' compressor state (8 ring slots per 128-token window page, (2 x 2 x 512 + 2 x 2 x 128) x 4 B each)
    at a tenth of the full pool's tokens."""
    pool = sglang_v4_pool(load_spec(FLASH), 40 * GIB, 0.1, 256, speculative=False)
    swa_token = 584 * 43 + 8 / 128 * (2 * 2 * 512 + 2 * 2 * 128) * 4 * 21
    full_token = 584 * 21 / 4 + 584 * 20 / 128 + 132 * 21 / 4
    assert pool.bytes_per_full_token == pytest.approx(full_token + 0.1 * swa_token)
    assert pool.swa_tokens == pytest.approx(0.1 * pool.full_tokens, abs=256)
    # the HCA layers' state: (257 slots x 128 ring + 129 rows, rounded up to 128) x 2 x 512 x 4 B x 20 layers
    assert pool.request_state_bytes == -(-(257 * 128 + 129) // 128) * 128 * 2 * 512 * 4 * 20


def test_speculative_decoding_takes_a_layer_s_share_and_longer_rings() -> None:
    spec = load_spec(FLASH)
    plain = sglang_v4_pool(spec, 40 * GIB, 0.1, 256, speculative=False)
    drafting = sglang_v4_pool(spec, 40 * GIB, 0.1, 256, speculative=True)
    assert drafting.bytes_per_full_token > plain.bytes_per_full_token * 44 / 43
    assert drafting.request_state_bytes > 1.9 * plain.request_state_bytes


def test_the_sliding_window_pool_holds_prompts_and_caps_the_batch() -> None:
    """A request keeps its prompt in the SWA pool: twice the prompt, about half the requests; the full pool, a
    tenth of whose tokens the SWA pool is, holds ten times more."""
    pool = sglang_v4_pool(load_spec(PRO), 15 * GIB, 0.1, 256, speculative=False)
    short, long = pool.sequences(4096, 4608), pool.sequences(8192, 9216)
    assert 0 < long < short <= 2 * long + 1
    assert pool.full_tokens // 4608 > 5 * short


def test_v4_pro_on_h200_runs_the_few_requests_the_cookbook_measured_on_sglang_only() -> None:
    """SGLang's V4 cookbook: V4-Pro on 8 x H200 (TP8, --mem-fraction-static 0.88) holds 'only ~15 requests'; its
    cells decode 15-35 at a time (Little's law). The planner's cache model, vLLM's, admits 150."""
    config = PlanConfig(
        model=PRO, gpu="h200", gpus=8, engine="sglang", input_len=4096, output_len=512, gpu_memory_utilization=0.88
    )
    sglang = make_plan(config).deployment
    assert sglang.engine_pool_sequences_per_rank is not None and 15 <= sglang.running_cap <= 40
    vllm = make_plan(config.model_copy(update={"engine": "vllm"})).deployment
    assert vllm.engine_pool_sequences_per_rank is None and vllm.running_cap > 100
