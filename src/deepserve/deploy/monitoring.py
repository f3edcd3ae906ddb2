"""What every rendered deployment watches: Prometheus alert rules and a Grafana dashboard over the series the gateway
exports (gateway/metrics.py) and the ones vLLM exports at its /metrics (vllm/v1/metrics/loggers.py). Each target
labels its scrape targets `component="engine"` or `component="gateway"`, so one set of expressions serves all.

The gateway's metric names live here once, vLLM's in engines/vllm_metrics.py; a test checks each against what the
gateway's registry and the installed vLLM actually export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepserve.engines import vllm_metrics as vllm
from deepserve.gateway.config import GatewayConfig

ENGINE = 'component="engine"'
GATEWAY = 'component="gateway"'
GATEWAY_REQUESTS = "deepserve_gateway_requests_total"
GATEWAY_COMPLETION_TOKENS = "deepserve_gateway_completion_tokens_total"
GATEWAY_TTFT = "deepserve_gateway_ttft_seconds"
GATEWAY_ITL = "deepserve_gateway_itl_seconds"
GATEWAY_E2E = "deepserve_gateway_e2e_seconds"
GATEWAY_QUEUE = "deepserve_gateway_queue_depth"
GATEWAY_IN_FLIGHT = "deepserve_gateway_in_flight"
GATEWAY_REJECTIONS = "deepserve_gateway_rejections_total"
GATEWAY_UPSTREAM_HEALTHY = "deepserve_gateway_upstream_healthy"

KV_CACHE_ALERT_FRACTION = 0.9
ERROR_RATE_ALERT_FRACTION = 0.05
QUEUE_ALERT_FRACTION = 0.5  # of the gateway's --max-queue, beyond which it answers 503


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def alerts(gateway: GatewayConfig) -> list[Alert]:
    queue_limit = max(int(gateway.max_queue * QUEUE_ALERT_FRACTION), 1)
    requests = f"sum(rate({GATEWAY_REQUESTS}{{{GATEWAY}}}[5m]))"
    errors = f'sum(rate({GATEWAY_REQUESTS}{{{GATEWAY},status=~"5.."}}[5m]))'
    return [
        Alert(
            "DeepserveEngineDown",
            f"absent(up{{{ENGINE}}} == 1)",
            "5m",
            "critical",
            "No engine replica answers its /metrics",
            "Every engine replica is down or still starting (a 671B model takes tens of minutes to load); the "
            "gateway answers 503. Check the engine pods' or containers' logs.",
        ),
        Alert(
            "DeepserveReplicaOutOfRotation",
            f"{GATEWAY_UPSTREAM_HEALTHY}{{{GATEWAY}}} == 0",
            "10m",
            "warning",
            "An engine replica failed the gateway's health checks",
            "The gateway stopped sending requests to {{ $labels.replica }}; the other replicas carry its load.",
        ),
        Alert(
            "DeepserveQueueGrowing",
            f"sum({vllm.WAITING}{{{ENGINE}}}) > 0 and deriv(sum({vllm.WAITING}{{{ENGINE}}})[10m:1m]) > 0",
            "10m",
            "warning",
            "Requests wait longer and longer for the engine",
            "vLLM's waiting queue has grown for 10 minutes: load exceeds capacity. Add replicas or lower the "
            "gateway's --max-concurrency.",
        ),
        Alert(
            "DeepserveGatewayQueueFilling",
            f"max({GATEWAY_QUEUE}{{{GATEWAY}}}) > {queue_limit}",
            "5m",
            "warning",
            "The gateway's admission queue is over half full",
            f"Over {queue_limit} requests wait at the gateway; beyond {gateway.max_queue} (--max-queue) it answers "
            "503.",
        ),
        Alert(
            "DeepserveKVCacheNearlyFull",
            f"max({vllm.KV_CACHE_USAGE}{{{ENGINE}}}) > {KV_CACHE_ALERT_FRACTION}",
            "10m",
            "warning",
            f"The KV cache has been over {KV_CACHE_ALERT_FRACTION:.0%} full for 10 minutes",
            "New requests wait for cache blocks and running ones may be preempted (see "
            f"{vllm.PREEMPTIONS}): lower --max-num-seqs or --max-model-len, use an FP8 KV cache, or add replicas.",
        ),
        Alert(
            "DeepserveHighErrorRate",
            f"{errors} / clamp_min({requests}, 1e-9) > {ERROR_RATE_ALERT_FRACTION}",
            "5m",
            "critical",
            f"Over {ERROR_RATE_ALERT_FRACTION:.0%} of requests fail with a 5xx",
            "The gateway answers 5xx (engine errors, timeouts, or a full queue). See "
            f"{GATEWAY_REJECTIONS} by reason and the engine logs.",
        ),
    ]


def rule_groups(gateway: GatewayConfig) -> dict[str, Any]:
    """Prometheus's rule file (and a PrometheusRule's spec)."""
    return {"groups": [{"name": "deepserve", "rules": [alert.rule() for alert in alerts(gateway)]}]}


# ---- the Grafana dashboard --------------------------------------------------------------------------------------


def _quantiles(metric: str, selector: str, label: str) -> list[tuple[str, str]]:
    return [
        (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate({metric}_bucket{{{selector}}}[5m])))") for q in (50, 99)
    ] + [(f"mean {label}", f"sum(rate({metric}_sum{{{selector}}}[5m])) / sum(rate({metric}_count{{{selector}}}[5m]))")]


PANELS: tuple[tuple[str, str, list[tuple[str, str]]], ...] = (
    # (title, unit, [(legend, PromQL)])
    ("Requests per second by status", "reqps", [("{{status}}", f"sum by (status) (rate({GATEWAY_REQUESTS}[1m]))")]),
    (
        "Error ratio (5xx)",
        "percentunit",
        [
            (
                "5xx",
                f'sum(rate({GATEWAY_REQUESTS}{{status=~"5.."}}[5m]))'
                f" / clamp_min(sum(rate({GATEWAY_REQUESTS}[5m])), 1e-9)",
            )
        ],
    ),
    ("Time to first token (gateway)", "s", _quantiles(GATEWAY_TTFT, GATEWAY, "TTFT")),
    ("Inter-token latency (gateway)", "s", _quantiles(GATEWAY_ITL, GATEWAY, "ITL")),
    ("End-to-end latency (gateway)", "s", _quantiles(GATEWAY_E2E, GATEWAY, "E2E")),
    (
        "Tokens per second",
        "short",
        [
            ("output", f"sum(rate({vllm.GENERATION_TOKENS}{{{ENGINE}}}[1m]))"),
            ("prompt", f"sum(rate({vllm.PROMPT_TOKENS}{{{ENGINE}}}[1m]))"),
        ],
    ),
    (
        "Requests in the engine and at the gateway",
        "short",
        [
            ("running (vLLM)", f"sum({vllm.RUNNING}{{{ENGINE}}})"),
            ("waiting (vLLM)", f"sum({vllm.WAITING}{{{ENGINE}}})"),
            ("queued (gateway)", f"sum({GATEWAY_QUEUE}{{{GATEWAY}}})"),
            ("in flight (gateway)", f"sum({GATEWAY_IN_FLIGHT}{{{GATEWAY}}})"),
        ],
    ),
    ("KV-cache usage", "percentunit", [("{{instance}}", f"{vllm.KV_CACHE_USAGE}{{{ENGINE}}}")]),
    (
        "Prefix-cache hit rate",
        "percentunit",
        [
            (
                "hits",
                f"sum(rate({vllm.PREFIX_CACHE_HITS}{{{ENGINE}}}[5m]))"
                f" / clamp_min(sum(rate({vllm.PREFIX_CACHE_QUERIES}{{{ENGINE}}}[5m])), 1e-9)",
            )
        ],
    ),
    ("Preemptions per second", "short", [("preemptions", f"sum(rate({vllm.PREEMPTIONS}{{{ENGINE}}}[5m]))")]),
    ("Time to first token (engine)", "s", _quantiles(vllm.TTFT, ENGINE, "TTFT")),
    ("Inter-token latency (engine)", "s", _quantiles(vllm.ITL, ENGINE, "ITL")),
    ("End-to-end latency (engine)", "s", _quantiles(vllm.E2E_LATENCY, ENGINE, "E2E")),
    (
        "Replicas in rotation",
        "short",
        [("healthy", f"sum({GATEWAY_UPSTREAM_HEALTHY}{{{GATEWAY}}})"), ("engines up", f"sum(up{{{ENGINE}}})")],
    ),
    (
        "Output tokens per second by key",
        "short",
        [("{{key}}", f"sum by (key) (rate({GATEWAY_COMPLETION_TOKENS}{{{GATEWAY}}}[5m]))")],
    ),
    ("Gateway rejections by reason", "reqps", [("{{reason}}", f"sum by (reason) (rate({GATEWAY_REJECTIONS}[5m]))")]),
)
DASHBOARD_UID = "deepserve"

# The GPUs, from NVIDIA's DCGM exporter (its default counters, NVIDIA/dcgm-exporter etc/default-counters.csv):
# utilisation (%), framebuffer used (MiB), power (W), temperature (C), and the tensor pipes' activity (profiling
# counter, 0-1). With Kubernetes pod mapping each series carries the pod it serves (`pod`, `namespace`).
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"
DCGM_TEMPERATURE = "DCGM_FI_DEV_GPU_TEMP"
DCGM_TENSOR_ACTIVE = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"


def gpu_panels(selector: str = "") -> tuple[tuple[str, str, list[tuple[str, str]]], ...]:
    """Panels per GPU of the engines (SELECTOR picks their series, e.g. by pod name)."""
    legend = "{{Hostname}} GPU {{gpu}}"
    return (
        ("GPU utilisation (DCGM)", "percent", [(legend, f"{DCGM_GPU_UTIL}{{{selector}}}")]),
        ("Tensor-core activity (DCGM)", "percentunit", [(legend, f"{DCGM_TENSOR_ACTIVE}{{{selector}}}")]),
        ("GPU memory used (DCGM)", "decmbytes", [(legend, f"{DCGM_FB_USED}{{{selector}}}")]),
        (
            "GPU power and temperature (DCGM)",
            "short",
            [
                (f"{legend} W", f"{DCGM_POWER}{{{selector}}}"),
                (f"{legend} C", f"{DCGM_TEMPERATURE}{{{selector}}}"),
            ],
        ),
    )


def dashboard(title: str = "deepserve", gpu_selector: str = "") -> dict[str, Any]:
    """A Grafana dashboard (schema 39) of PANELS and the GPU panels, two per row, on a Prometheus data source chosen
    by variable."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for index, (panel_title, unit, queries) in enumerate(PANELS + gpu_panels(gpu_selector)):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel_title,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + n), "datasource": datasource, "expr": expr, "legendFormat": legend}
                    for n, (legend, expr) in enumerate(queries)
                ],
            }
        )
    return {
        "uid": DASHBOARD_UID,
        "title": title,
        "tags": ["deepserve", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}]
        },
        "panels": panels,
    }


def queries() -> list[str]:
    """Every PromQL expression the alerts and the dashboard use (the metric-name test reads them)."""
    exprs = [alert.expr for alert in alerts(GatewayConfig())]
    exprs += [expr for _, _, targets in PANELS + gpu_panels() for _, expr in targets]
    return exprs
