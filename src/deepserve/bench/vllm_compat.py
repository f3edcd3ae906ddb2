"""What of `vllm bench serve` deepserve bench refuses, with why and what to use instead: one table for its flags
and one for its dataset names, sharing their reasons, so that a flag and its dataset fail with the same words.
The CLI recognises the flags (so that a vLLM command line parses) and refuses them; the workload config refuses
the dataset names."""

from __future__ import annotations

HUB = (
    "deepserve never downloads from the Hugging Face hub; export the prompts to JSONL and use --dataset-name custom "
    "--dataset-path FILE"
)
TEXT_ONLY = "deepserve bench measures text generation (completions, chat); use --dataset-name random or custom"
REPORT = "deepserve draws charts from saved results: add --save-result, then run `deepserve report`"
NOT_BUILT_IN = "this dataset is not built in; convert it to JSONL and use --dataset-name custom --dataset-path FILE"

# True: the flag takes a value
REFUSED_VLLM_FLAGS: dict[str, tuple[bool, str]] = {
    "--hf-name": (True, HUB),
    "--hf-split": (True, HUB),
    "--hf-subset": (True, HUB),
    "--hf-output-len": (True, HUB),
    "--blazedit-min-distance": (True, HUB),
    "--blazedit-max-distance": (True, HUB),
    "--bfcl-categories": (True, HUB),
    "--speed-bench-dataset-subset": (True, HUB),
    "--speed-bench-output-len": (True, HUB),
    "--speed-bench-category": (True, HUB),
    "--spec-bench-output-len": (True, NOT_BUILT_IN),
    "--spec-bench-category": (True, NOT_BUILT_IN),
    "--asr-max-audio-len-sec": (True, TEXT_ONLY),
    "--asr-min-audio-len-sec": (True, TEXT_ONLY),
    "--random-mm-base-items-per-request": (True, TEXT_ONLY),
    "--random-mm-num-mm-items-range-ratio": (True, TEXT_ONLY),
    "--random-mm-limit-mm-per-prompt": (True, TEXT_ONLY),
    "--random-mm-bucket-config": (True, TEXT_ONLY),
    "--random-batch-size": (True, TEXT_ONLY + " (batched inputs are for embedding and reranking)"),
    "--no-reranker": (False, TEXT_ONLY),
    "--enable-multimodal-chat": (False, TEXT_ONLY),
    "--custom-ensure-client-side-data": (False, TEXT_ONLY + " (the flag is about images of custom_image)"),
    "--plot-timeline": (False, REPORT),
    "--timeline-itl-thresholds": (True, REPORT),
    "--plot-dataset-stats": (False, REPORT),
    "--use-beam-search": (
        False,
        "streamed beam search has no per-token timing (vLLM's server refuses it on /v1/completions and sends one "
        "chunk on chat; vLLM's client never sends it either), so TTFT and ITL would mean nothing: leave it out",
    ),
    "--probe-request-rate": (
        True,
        "probe requests are not implemented; run a second `deepserve bench` at a low --request-rate beside this one",
    ),
}

REFUSED_VLLM_DATASETS: dict[str, str] = {
    "hf": HUB,
    "speed_bench": HUB,
    "burstgpt": NOT_BUILT_IN,
    "spec_bench": NOT_BUILT_IN,
    "sonnet": "this dataset is not built in; use --dataset-name prefix_repetition (shared prefixes, as sonnet's), or "
    "convert it to JSONL and use --dataset-name custom --dataset-path FILE",
    "random-mm": TEXT_ONLY,
    "random-rerank": TEXT_ONLY,
    "custom_audio": TEXT_ONLY,
    "custom_image": TEXT_ONLY,
}


def refused_flag(flag: str) -> str:
    """The one-line error for a refused vLLM flag."""
    return f"{flag} (a `vllm bench serve` flag) is not supported: {REFUSED_VLLM_FLAGS[flag][1]}"


def refused_dataset(name: str) -> str:
    """The one-line error for a vLLM dataset name that is not built in."""
    return f"dataset {name!r} (a `vllm bench serve` dataset) is not supported: {REFUSED_VLLM_DATASETS[name]}"
