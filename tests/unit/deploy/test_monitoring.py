"""Every metric the rendered alerts and dashboard use is one that exists: the gateway's (read from its own registry)
or vLLM's (read from the installed vLLM's metric definitions). The alerts cover what the issue asks for."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from deepserve.deploy.monitoring import PANELS, alerts, dashboard, gpu_panels, queries, rule_groups
from deepserve.gateway.balancing import make_policy
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.limits import make_limiter
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.gateway.upstreams import UpstreamPool
from tests.helpers import SAMPLE_SUFFIXES, present, samples, vllm_exported_samples


def gateway_samples() -> set[str]:
    pool = UpstreamPool(["http://127.0.0.1:9/v1"], make_policy("least_outstanding"))
    metrics = GatewayMetrics(pool, make_limiter(GatewayConfig()))  # the product's limiter, from its factory
    names: set[str] = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.type in SAMPLE_SUFFIXES:
            names |= samples(family.type, family.name)
    return names


def used_metrics() -> set[str]:
    used: set[str] = set()
    for expr in queries():
        used |= set(re.findall(r"(?:vllm:|deepserve_)[a-zA-Z0-9_:]+", expr))
    return used


def test_every_metric_the_alerts_and_dashboard_use_is_exported() -> None:
    exported = gateway_samples() | vllm_exported_samples()
    used = used_metrics()
    assert used - exported == set()
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "deepserve_gateway_requests_total"} <= used


def test_the_check_catches_a_name_nobody_exports() -> None:
    exported = gateway_samples() | vllm_exported_samples()
    assert "vllm:gpu_cache_usage_perc" not in exported  # vLLM's old name, gone from V1
    assert "deepserve_gateway_requests" not in exported  # a counter's samples end in _total


def test_alerts_cover_engine_down_queue_kv_cache_and_errors() -> None:
    by_name = {alert.name: alert for alert in alerts(GatewayConfig())}
    assert "up{" in by_name["DeepserveEngineDown"].expr
    assert "vllm:num_requests_waiting" in by_name["DeepserveQueueGrowing"].expr
    assert "vllm:kv_cache_usage_perc" in by_name["DeepserveKVCacheNearlyFull"].expr
    assert 'status=~"5.."' in by_name["DeepserveHighErrorRate"].expr
    for alert in by_name.values():
        assert alert.severity in ("warning", "critical") and alert.summary and alert.description


def test_rule_file_shape_is_prometheus_s() -> None:
    groups = rule_groups(GatewayConfig())["groups"]
    assert [rule["alert"] for rule in groups[0]["rules"]] == [alert.name for alert in alerts(GatewayConfig())]
    assert all(set(rule) == {"alert", "expr", "for", "labels", "annotations"} for rule in groups[0]["rules"])


def test_dashboard_has_a_panel_per_entry_laid_out_without_overlap() -> None:
    board = dashboard("x")
    panels = board["panels"]
    assert len(panels) == len(PANELS) + len(gpu_panels())
    cells = {(panel["gridPos"]["x"], panel["gridPos"]["y"]) for panel in panels}
    assert len(cells) == len(panels)
    assert all(target["expr"] for panel in panels for target in panel["targets"])
    assert board["templating"]["list"][0]["type"] == "datasource"


def test_the_dashboard_has_gpu_panels_from_the_dcgm_exporter() -> None:
    """DCGM exporter's default counters (NVIDIA/dcgm-exporter etc/default-counters.csv)."""
    exprs = [target["expr"] for panel in dashboard("x", 'pod=~"a-.*"')["panels"] for target in panel["targets"]]
    dcgm = {present(re.match(r"DCGM_[A-Z_]+", expr)).group(0) for expr in exprs if expr.startswith("DCGM_")}
    assert dcgm == {
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP",
    }
    assert all('{pod=~"a-.*"}' in expr for expr in exprs if expr.startswith("DCGM_"))
