from __future__ import annotations

import re
from pathlib import Path

from deepserve.cli.main import main
from deepserve.report.build import build_report, load_sets
from deepserve.results.slo import Slo

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"


def test_report_is_self_contained_with_every_point_and_the_metadata(tmp_path: Path):
    sets = load_sets([FIXTURES / "h100_vllm_concurrency", FIXTURES / "h100_v3_rate"])
    report = build_report(sets, tmp_path, [Slo("p99_itl_ms", 50)])
    html = report.html_path.read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sources and all(source.startswith("data:image/png;base64,") for source in sources)
    assert "http://" not in html.replace("http://node:8000", "") and "https://" not in html
    assert html.count("<img ") == len(report.charts) >= 5
    rows = re.findall(r"<tr><td class=\"text\">", html)
    assert len(rows) == sum(len(s.points) for s in sets) == 26
    for fact in ("8x NVIDIA H100 SXM5 80GB", "0.7.3", "--max-num-seqs 128", "deepserve sweep --suite concurrency"):
        assert fact in html
    assert "the highest concurrency that meets P99 ITL ≤ 50 ms is 4" in html
    assert "saturates at about 2.75 requests/s" in html


def test_labels_are_escaped_and_repeated_labels_numbered(tmp_path: Path):
    sets = load_sets([FIXTURES / "h100_v3_rate", FIXTURES / "h100_r1_rate"], ["<b>A</b>", "<b>A</b>"])
    assert [s.label for s in sets] == ["<b>A</b>", "<b>A</b> (2)"]
    html = build_report(sets, tmp_path, []).html_path.read_text()
    assert "<b>A</b>" not in html and "&lt;b&gt;A&lt;/b&gt; (2)" in html


def test_cli_report_writes_html_and_pngs(tmp_path: Path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "report",
            str(FIXTURES / "h100_vllm_concurrency"),
            str(FIXTURES / "h100_sglang_concurrency"),
            "--out",
            str(out),
            "--label",
            "vLLM",
            "--label",
            "SGLang",
            "--slo",
            "p99_itl_ms=100",
            "--gpus",
            "4",
            "--gpu-hour-usd",
            "2.5",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "vLLM: the highest concurrency that meets P99 ITL ≤ 100 ms is 15" in printed
    assert "SGLang: decode runs at" in printed and "of the hardware's memory-bandwidth limit" in printed
    assert "8 x $2.50 per hour" in printed  # the runs recorded 8 GPUs: --gpus is for sets that recorded none
    assert (out / "report.html").is_file()
    assert {p.name for p in out.glob("*.png")} == {
        "throughput_vs_concurrency.png",
        "itl_vs_concurrency.png",
        "ttft_ttlt_vs_concurrency.png",
        "throughput_vs_latency.png",
        "pareto.png",
        "cost_per_million_tokens.png",
        "decode_vs_hardware_limit.png",
    }
    html = (out / "report.html").read_text()
    for heading in ("GPUs", "output tok/s per GPU", "tok/s per user", "USD per M output tok", "% of limit"):
        assert f"<th>{heading}</th>" in html
    assert "8 GPUs (recorded hardware: 8x NVIDIA H100 SXM5 80GB)" in html
    assert "$2.50 per GPU-hour (--gpu-hour-usd)" in html


def test_cli_report_from_stored_runs(tmp_path: Path, capsys):
    from deepserve.results.store import record_run
    from deepserve.results.sweepdir import load_result_set

    ids = [
        str(record_run(point.result, label="stored")) for point in load_result_set(FIXTURES / "b200_vllm_loose").points
    ]
    assert main(["report", "--runs", ",".join(ids), "--out", str(tmp_path)]) == 0
    assert "stored: the highest concurrency that meets P99 ITL ≤ 50 ms is 32" in capsys.readouterr().out


def test_cli_report_errors_are_one_line(tmp_path: Path, capsys):
    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(FIXTURES / "h100_v3_rate"), "--out", str(tmp_path / "o"), "--gpus", "0"]) == 2
    assert "--gpus 0: give the number of GPUs" in capsys.readouterr().err
    assert main(["report", "--out", str(tmp_path / "o")]) == 2


def test_repeated_runs_reasoning_and_speculative_decoding_show_in_the_points_table(tmp_path: Path):
    from deepserve.report.html import _points_html
    from deepserve.results.points import PointParams, ResultPoint, ResultSet

    result = {
        "completed": 10, "duration": 5.0, "median_ttft_ms": 120.0, "num_runs": 5, "mean_reasoning_tokens": 42.0,
        "median_answer_ttft_ms": 900.0, "median_tool_call_end_ms": 1500.0,
        "confidence_intervals": {"median_ttft_ms": {"ci95_half_width": 7.5}},
        "server_metrics": {"spec_decode": {"acceptance_rate": 0.6, "mean_acceptance_length": 2.8}},
    }  # fmt: skip
    plain = ResultPoint("plain", PointParams(max_concurrency=1), {"completed": 1, "duration": 1.0})
    table = _points_html([ResultSet("s", [ResultPoint("p", PointParams(max_concurrency=4), result), plain])])
    assert "<td>120.00 ± 7.50</td>" in table
    for heading in ("runs", "mean reasoning tokens", "median answer TTFT (ms)", "spec. mean acceptance length"):
        assert f"<th>{heading}</th>" in table
    assert "<td>2.80</td>" in table and "<td>0.60</td>" in table
    assert "median reasoning TTFT" not in table  # no point has it: no column
