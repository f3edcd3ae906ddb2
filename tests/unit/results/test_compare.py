"""The regression gate: thresholds, noise (non-overlapping 95% intervals), sweeps point by point, the CLI's exit
code. Results are hand-made; tests/integration/bench/test_regression_gate.py runs it on the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.cli.main import main
from deepserve.errors import ConfigError
from deepserve.results.compare import Span, Threshold, compare_results, judge, parse_fail_on
from deepserve.results.points import PointParams, ResultPoint, ResultSet


def result(ttft: float, throughput: float, ttft_ci: tuple[float, float] | None = None, **extra) -> dict:
    data = {"completed": 10, "duration": 1.0, "p99_ttft_ms": ttft, "output_throughput": throughput, **extra}
    if ttft_ci is not None:
        data["confidence_intervals"] = {"p99_ttft_ms": {"ci95_low": ttft_ci[0], "ci95_high": ttft_ci[1], "n": 5}}
    return data


def test_fail_on_parses_direction_and_percentage():
    assert parse_fail_on("p99_ttft_ms=+10%") == Threshold("p99_ttft_ms", 1, 0.10)
    assert parse_fail_on("output_throughput=-5%") == Threshold("output_throughput", -1, 0.05)
    assert parse_fail_on("median_itl_ms:+2.5%").fraction == pytest.approx(0.025)
    for bad in ("p99_ttft_ms=10%", "p99_ttft_ms=+10", "=+1%", "p99_ttft_ms>+10%"):
        with pytest.raises(ConfigError, match="METRIC=\\+N%"):
            parse_fail_on(bad)


def test_a_change_beyond_the_threshold_fails_single_runs():
    up = Threshold("p99_ttft_ms", 1, 0.10)
    assert not judge(up, Span(100), Span(109)).regressed
    verdict = judge(up, Span(100), Span(111))
    assert verdict.regressed and verdict.change == pytest.approx(0.11) and "REGRESSION" in verdict.why
    assert "single runs" in verdict.why
    assert not judge(up, Span(100), Span(50)).regressed  # faster is never a regression
    down = Threshold("output_throughput", -1, 0.05)
    assert judge(down, Span(1000), Span(940)).regressed and not judge(down, Span(1000), Span(960)).regressed


def test_beyond_the_threshold_but_within_noise_passes():
    up = Threshold("p99_ttft_ms", 1, 0.10)
    overlapping = judge(up, Span(100, 80, 120, 5), Span(115, 105, 125, 5))
    assert not overlapping.regressed and "within noise" in overlapping.why
    apart = judge(up, Span(100, 95, 105, 5), Span(115, 110, 120, 5))
    assert apart.regressed and "beyond the runs' 95% confidence intervals" in apart.why
    down = Threshold("output_throughput", -1, 0.05)
    assert not judge(down, Span(1000, 900, 1100, 3), Span(900, 850, 950, 3)).regressed
    assert judge(down, Span(1000, 980, 1020, 3), Span(900, 880, 920, 3)).regressed


def test_a_missing_metric_fails_and_says_which_side_lacks_it():
    [verdict] = compare_results(result(100, 10), {"completed": 1}, [parse_fail_on("p99_ttft_ms=+10%")])
    assert verdict.regressed and "the candidate has no value" in verdict.why


def point(concurrency: int, ttft: float) -> ResultPoint:
    return ResultPoint(f"c{concurrency}", PointParams(max_concurrency=concurrency), result(ttft, 100.0))


def test_sweeps_compare_point_by_point(tmp_path: Path, capsys):
    from deepserve.results.compare import compare_sets

    base = ResultSet("base", [point(1, 100), point(4, 200)])
    cand = ResultSet("cand", [point(1, 101), point(4, 260)])
    verdicts = compare_sets(base, cand, [parse_fail_on("p99_ttft_ms=+10%")])
    assert [(v.where, v.regressed) for v in verdicts] == [("c=1 rate=inf", False), ("c=4 rate=inf", True)]
    missing = compare_sets(base, ResultSet("cand", [point(1, 100)]), [parse_fail_on("p99_ttft_ms=+10%")])
    assert missing[-1].regressed and "no such point" in missing[-1].why


def test_the_cli_exits_non_zero_on_a_regression_and_says_why(tmp_path: Path, capsys):
    baseline, same, slower = tmp_path / "b.json", tmp_path / "s.json", tmp_path / "c.json"
    baseline.write_text(json.dumps(result(100, 1000)))
    same.write_text(json.dumps(result(102, 990)))
    slower.write_text(json.dumps(result(130, 990)))
    gate = ["--fail-on", "p99_ttft_ms=+10%", "--fail-on", "output_throughput=-5%"]
    assert main(["runs", "compare", str(baseline), str(same), *gate]) == 0
    assert "PASS: 2 checks" in capsys.readouterr().out
    assert main(["runs", "compare", str(baseline), str(slower), *gate]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: p99_ttft_ms 100 → 130 (+30.0%; allowed p99_ttft_ms +10%)" in out
    assert "FAIL: 1 of 2 checks regressed" in out
    assert main(["runs", "compare", str(baseline), *gate]) == 2  # bad usage: one result
