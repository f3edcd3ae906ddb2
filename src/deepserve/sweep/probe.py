"""What a sweep learns before it starts: the server's own facts (the report's run metadata) and, for a suite, a
short speed probe that tells it how far to scale."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError
from deepserve.hardware.detect import local_gpus
from deepserve.hardware.host import HostMeasurement, measured_host
from deepserve.results.deployment import DEPLOYMENT_KEY, cpu_deployment, gpu_deployment, model_config_for
from deepserve.results.sweepdir import now_iso
from deepserve.sweep.grid import apply_overrides
from deepserve.sweep.run import PointRunner
from deepserve.sweep.suites import SpeedProbe, fit_prefill


def server_facts(base: BenchConfig, measure_host: Callable[[], HostMeasurement] = measured_host) -> dict[str, Any]:
    """What the server says about itself (model, engine, version, context length) and, for a server on this
    machine, its hardware: the report's run metadata. Best effort: the benchmark's own preflight reports a server
    that cannot be reached. The deployment facts (see `deepserve.results.deployment`) let the report put the runs
    against the hardware's limit: the model's config.json where it is known here, and for a server on this machine
    its GPUs, or for a CPU-only host the memory bandwidth deepserve measures (once per host; MEASURE_HOST)."""
    target = base.target
    facts: dict[str, Any] = {"base_url": target.root_url, "date": now_iso()}
    card: dict[str, Any] = {}
    try:
        models = httpx.get(f"{target.root_url}/v1/models", headers=target.request_headers(), timeout=10).json()
        cards = models.get("data") or []
        card = next((c for c in cards if c.get("id") == target.model), cards[0] if cards else {})
        facts |= {"model": card.get("id"), "engine": card.get("owned_by"), "max_model_len": card.get("max_model_len")}
        version = httpx.get(f"{target.root_url}/version", headers=target.request_headers(), timeout=10)
        if version.status_code == 200:
            facts["engine_version"] = version.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    local = urlsplit(target.root_url).hostname in ("127.0.0.1", "localhost", "::1")
    if local:
        facts["hardware"] = local_hardware()
    deployment = _deployment_facts(card, local, measure_host)
    if deployment:
        facts[DEPLOYMENT_KEY] = deployment
    return {key: value for key, value in facts.items() if value is not None}


def _deployment_facts(card: dict[str, Any], local: bool, measure_host: Callable[[], HostMeasurement]) -> dict[str, Any]:
    """The served model's architecture (vLLM names the loaded path `root`, the served name `id`) and, on this
    machine, its devices. A CPU host is measured only when the model is known: the bandwidth serves the report's
    hardware limit, which needs the model's bytes per step too."""
    names = [str(card[key]) for key in ("root", "id") if isinstance(card.get(key), str)]
    config = model_config_for(names) if names else None
    facts: dict[str, Any] = {"model_config": config} if config is not None else {}
    if not local:
        return facts
    gpus = local_gpus()
    if gpus:
        facts |= gpu_deployment(gpus)
    elif config is not None:
        try:
            facts |= cpu_deployment(measure_host())
        except (OSError, MemoryError) as exc:  # no room for the copy arrays, or no writable home: no limit line
            facts["host_measurement_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def local_hardware() -> str:
    gpus = local_gpus()
    if gpus:
        return f"{len(gpus)}x {gpus[0].name} ({gpus[0].memory_mib // 1024} GiB)"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU only: {os.cpu_count()} cores, {cpu}"


def probe_speed(base: BenchConfig, run_point: PointRunner, context_len: int | None) -> SpeedProbe:
    """Four short runs that tell a suite how far to scale: a short and a long prompt alone (prefill time against
    length, time per output token), 64 requests at concurrency 32 (peak output tokens/s) and 32 prompts at once
    (batched prefill tokens/s). Seconds on the tiny model."""
    short_len = min(1024, (context_len or 4096) // 8)
    long_len = min(4 * short_len, (context_len or 4096) // 2)
    common = {"dataset_name": "random", "request_rate": None, "duration_s": None, "ignore_eos": True}
    alone = {"max_concurrency": 1, "random_output_len": 32}
    short = run_point(apply_overrides(base, common | alone | {"num_prompts": 2, "random_input_len": short_len}))
    long = run_point(apply_overrides(base, common | alone | {"num_prompts": 1, "random_input_len": long_len}))
    batch = run_point(
        apply_overrides(
            base, common | {"num_prompts": 64, "max_concurrency": 32, "random_input_len": 64, "random_output_len": 64}
        )
    )
    prefills = run_point(
        apply_overrides(
            base, common | {"num_prompts": 32, "max_concurrency": 32, "random_input_len": 512, "random_output_len": 1}
        )
    )
    short_ms, long_ms = short.get("median_ttft_ms"), long.get("median_ttft_ms")
    tpot_ms, peak = short.get("median_tpot_ms"), batch.get("output_throughput")
    if not short_ms or not long_ms or not tpot_ms or not peak:
        raise ConfigError(
            "the speed probe got no timings from the server (every probe request failed?); check the server, or pass "
            "--time-budget-s 0 to run the suite at the seeds' sizes"
        )
    prefill_tok_s, quadratic = fit_prefill(short_len, float(short_ms) / 1000, long_len, float(long_ms) / 1000)
    return SpeedProbe(
        prefill_tok_s=prefill_tok_s,
        tpot_s=float(tpot_ms) / 1000,
        peak_output_tok_s=float(peak),
        prefill_s_per_tok2=quadratic,
        batched_prefill_tok_s=_input_tok_s(prefills),
    )


def _input_tok_s(result: dict[str, Any]) -> float | None:
    tokens, duration_s = result.get("total_input_tokens"), result.get("duration")
    return float(tokens) / float(duration_s) if tokens and duration_s else None
