"""vLLM's Prometheus series at its /metrics, as its V1 engine exports them (vllm/v1/metrics/loggers.py): the names,
the labels and the histogram buckets. Everything that reads a vLLM server (the benchmark's server metrics, the
gateway's engine_aware routing, rendered alert rules and dashboards) or pretends to be one (`deepserve simulate`)
takes them from here. Counters are named as exposed, with their `_total` suffix."""

from __future__ import annotations

# ---- gauges -------------------------------------------------------------------------------------------------------
RUNNING = "vllm:num_requests_running"  # requests in the running batch
WAITING = "vllm:num_requests_waiting"  # requests queued, not yet scheduled
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # fraction (0..1) of the KV cache in use
KV_CACHE_USAGE_BEFORE_0_10 = "vllm:gpu_cache_usage_perc"  # the same before vLLM 0.10
KV_CACHE_USAGE_NAMES = (KV_CACHE_USAGE, KV_CACHE_USAGE_BEFORE_0_10)  # the newer name first
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # value 1, the cache configuration in its labels

# ---- counters ------------------------------------------------------------------------------------------------------
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up in the prefix cache
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"  # of which found there
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"  # labelled finished_reason
# speculative decoding (vllm/v1/spec_decode/metrics.py): acceptance rate = accepted / draft tokens, mean acceptance
# length = 1 + accepted / drafts, acceptance at draft position i = accepted at i / drafts
SPEC_DECODE_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DECODE_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled position="i"
SPEC_DECODE_POSITION_LABEL = "position"

# ---- histograms (seconds, or tokens) -------------------------------------------------------------------------------
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # a histogram despite its name

# ---- labels and buckets --------------------------------------------------------------------------------------------
MODEL_LABEL = "model_name"
ENGINE_LABEL = "engine"  # the engine core's index within one server
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, … up to MAX_VALUE: the buckets of vLLM's token-count histograms (request prompt and
    generation tokens), up to the server's max_model_len."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10
