"""TensorRT-LLM's serving metrics, as `trtllm-serve` exports them.

Two endpoints (NVIDIA/TensorRT-LLM examples/serve/prometheus_metrics.py @ 47d640ec; serve/openai_server.py's
routes): `/prometheus/metrics` in Prometheus's text format, every series prefixed `trtllm_`, and `/metrics`, which
is not Prometheus text but a JSON list of per-iteration statistics (filled when the options file sets
enable_iter_perf_stats). The names below are those of tensorrt_llm/metrics/collector.py's MetricsCollector (2026
version: "Created Prometheus metrics"); older releases exported only the request histograms and the KV-cache
gauges, so readers must treat every series as optional. Counters are named as exposed, with `_total`.
"""

from __future__ import annotations

PROMETHEUS_PATH = "/prometheus/metrics"
ITERATION_STATS_PATH = "/metrics"  # JSON, not Prometheus text
PREFIX = "trtllm_"

# ---- gauges (per iteration) ----------------------------------------------------------------------------------------
RUNNING = "trtllm_num_requests_running"  # active requests
WAITING = "trtllm_num_requests_waiting"  # queued requests
KV_CACHE_USAGE = "trtllm_kv_cache_utilization"  # fraction (0..1) of the KV-cache blocks in use
KV_CACHE_HIT_RATE = "trtllm_kv_cache_hit_rate"
ITERATION_LATENCY = "trtllm_iteration_latency_seconds"
SPEC_DECODE_ACCEPTANCE_LENGTH = "trtllm_spec_decode_acceptance_length"

# ---- counters ------------------------------------------------------------------------------------------------------
REQUEST_SUCCESS = "trtllm_request_success_total"  # labelled finished_reason
PROMPT_TOKENS = "trtllm_prompt_tokens_total"
GENERATION_TOKENS = "trtllm_generation_tokens_total"
KV_CACHE_REUSED_BLOCKS = "trtllm_kv_cache_reused_blocks_total"
KV_CACHE_MISSED_BLOCKS = "trtllm_kv_cache_missed_blocks_total"
SPEC_DECODE_DRAFT_TOKENS = "trtllm_spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS = "trtllm_spec_decode_num_accepted_tokens_total"

# ---- histograms (seconds) ------------------------------------------------------------------------------------------
TTFT = "trtllm_time_to_first_token_seconds"
TPOT = "trtllm_time_per_output_token_seconds"
E2E_LATENCY = "trtllm_e2e_request_latency_seconds"
QUEUE_TIME = "trtllm_request_queue_time_seconds"

# ---- labels --------------------------------------------------------------------------------------------------------
MODEL_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"
