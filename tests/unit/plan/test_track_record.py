"""The track record `plan` prints: held-out ratios summarised by layout kind, vendor and model generation, read
back, the nearest record with enough figures chosen, and the words that tell a user which way forecasts leaned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.plan.track_record import (
    HeldOutFigure,
    load_track_records,
    record_for,
    summarise,
)


def figures(
    kind: str, group: str, ratios: list[float], vendor: str = "nvidia", attention: str = "mla"
) -> list[HeldOutFigure]:
    return [HeldOutFigure(kind, vendor, attention, group, f"source-{i % 3}", ratio) for i, ratio in enumerate(ratios)]


def stored(tmp_path: Path, held: list[HeldOutFigure]) -> Path:
    path = tmp_path / f"track_record_{len(list(tmp_path.iterdir()))}.json"  # a new file each time: read by mtime
    path.write_text(json.dumps({"generated_by": "test", **summarise(held)}))
    return path


def test_a_layout_kind_summarised_by_metric() -> None:
    held = figures("dp-attention+ep", "throughput", [1.0, 1.2, 1.4, 1.6, 1.8, 3.0])
    held += figures("dp-attention+ep", "e2el", [1.0])  # not a recorded group
    records = summarise(held)["records"]
    keys = [(r["layout_kind"], r["attention"]) for r in records]
    assert keys == [("dp-attention+ep", "mla"), ("dp-attention+ep", "all"), ("all", "mla"), ("all", "all")]
    throughput = records[0]["metrics"]["throughput"]
    assert throughput["figures"] == 6 and throughput["sources"] == 3
    assert throughput["median_ratio"] == pytest.approx(1.5)
    assert throughput["low_ratio"] == pytest.approx(1.1) and throughput["high_ratio"] == pytest.approx(2.4)
    assert throughput["within_1_5x"] == pytest.approx(0.5)  # 1.0, 1.2, 1.4 of six
    assert set(records[0]["metrics"]) == {"throughput"}


def test_generations_are_told_apart_and_also_pooled() -> None:
    held = figures("tp", "throughput", [1.5] * 5, attention="compressed_sparse") + figures(
        "tp", "throughput", [0.9] * 5
    )
    records = {(r["layout_kind"], r["attention"]): r["metrics"]["throughput"] for r in summarise(held)["records"]}
    assert records[("tp", "compressed_sparse")]["median_ratio"] == pytest.approx(1.5)
    assert records[("tp", "mla")]["median_ratio"] == pytest.approx(0.9)
    assert records[("tp", "all")]["figures"] == 10


def test_words_say_which_way_forecasts_leaned(tmp_path: Path) -> None:
    held = figures("dp-attention+ep", "throughput", [1.4, 1.5, 1.6, 1.5, 1.45])
    held += figures("dp-attention+ep", "tpot", [0.5, 0.6, 0.55, 0.6, 0.5])
    held += figures("dp-attention+ep", "ttft", [0.9, 1.1, 1.0, 1.05, 0.95])
    record = record_for("dp-attention+ep", "nvidia", "mla", stored(tmp_path, held))
    assert record is not None and record.instead_of is None
    words = record.words()
    assert "(dp-attention+ep on MLA models (V3, R1, V3.1), nvidia GPUs)" in words
    assert "throughput 1.50x median" in words and "forecasts ran high: expect less" in words
    assert "tpot 0.55x median" in words and "forecasts ran low: expect higher" in words
    assert "ttft 1.00x median" in words and "100% within 1.5x" in words


def test_too_few_figures_falls_back_to_the_nearest_record_with_enough(tmp_path: Path) -> None:
    held = figures("tp+pp", "throughput", [1.1]) + figures("tp", "throughput", [0.9, 1.0, 1.1, 1.2, 0.8])
    held += figures("tp", "throughput", [2.0], attention="compressed_sparse")
    path = stored(tmp_path, held)
    record = record_for("tp+pp", "nvidia", "mla", path)
    assert record is not None and (record.layout_kind, record.attention) == ("all", "mla")
    assert "too few published figures for tp+pp on MLA models" in record.words()
    assert "6 figures, 3 sources" in record.words()
    v4 = record_for("tp", "nvidia", "compressed_sparse", path)  # one V4 figure: TP over every model instead
    assert v4 is not None and (v4.layout_kind, v4.attention) == ("tp", "all") and "6 figures" in v4.words()
    assert record_for("tp", "amd", "mla", path) is None  # nothing recorded for the vendor


def test_too_few_figures_anywhere_says_so(tmp_path: Path) -> None:
    path = stored(tmp_path, figures("tp", "throughput", [1.0, 1.1], vendor="amd"))
    record = record_for("tp", "amd", "mla", path)
    assert record is not None and record.words().endswith("too few published figures to say (throughput 2)")
    one_source = [HeldOutFigure("tp", "amd", "mla", "ttft", "only", 1.0) for _ in range(5)]
    record = record_for("tp", "amd", "mla", stored(tmp_path, one_source))
    assert record is not None and "(5 figures, 1 source)" in record.words()


def test_a_damaged_file_is_refused_with_how_to_regenerate_it(tmp_path: Path) -> None:
    path = tmp_path / "track_record.json"
    path.write_text('{"records": [{"layout_kind": "tp"}]}')
    with pytest.raises(ConfigError, match="plan validate --write-track-record"):
        load_track_records(path)


def test_the_packaged_record_covers_the_layouts_plan_forecasts() -> None:
    records = load_track_records()
    expected = {("tp", "nvidia", "mla"), ("tp", "nvidia", "compressed_sparse"), ("dp-attention+ep", "nvidia", "all")}
    assert expected | {("all", "nvidia", "all"), ("all", "amd", "all")} <= set(records)
    metrics = [m for record in records.values() for m in record.metrics]
    assert metrics and all(m.figures >= 1 and m.low_ratio <= m.median_ratio <= m.high_ratio for m in metrics)


def test_writing_it_from_a_partial_validation_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from deepserve.cli import main as cli_main

    assert cli_main.main(["plan", "validate", "--steady", "--write-track-record"]) == 2
    assert "drop --steady and --calibration" in capsys.readouterr().err
