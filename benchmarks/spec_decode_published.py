"""The plan's speculative step against published MTP runs: for every row of benchmarks/data/published_mtp_rows.csv
(the 115 MTP rows of the research notes, and the same setups without MTP where a source gives both), either the
plan's prediction with and without MTP beside the published figure, or why the plan cannot express the row.

    .venv/bin/python benchmarks/spec_decode_published.py [--markdown] [--all]

Rows are expressible when the model has a preset, the weights a format and the hardware a catalog entry, and the
lengths and concurrency are known. TensorRT-LLM and SGLang rows are predicted with vLLM's engine profile (the plan
has no other): read their ratios as how far that engine is from vLLM's overheads, as much as a check of the step.
The acceptance is the row's where it states one (a mean acceptance length L becomes one rate a with 1 + a + a^2 ...
+ a^K = L), else the plan's published default for MTP.
"""

from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass
from pathlib import Path

from deepserve.errors import DeepserveError
from deepserve.models.presets import canonical_preset_name
from deepserve.plan.perf import Prediction
from deepserve.plan.planner import make_plan
from deepserve.plan.types import PlanConfig

ROWS_PATH = Path(__file__).with_name("data") / "published_mtp_rows.csv"
HARDWARE = {"H200-SXM5-141GB": "h200", "H100-SXM5-80GB": "h100", "B200": "b200", "MI300X-192GB": "mi300x"}
WEIGHTS = {"fp8": "fp8"}
METRICS = {
    "output_throughput": "tok/s",
    "output_throughput_per_gpu": "tok/s/gpu",
    "output_throughput_per_user": "tok/s/user",
    "tpot_mean": "ms",
    "ttft_mean": "ms",
    "e2el": "ms",
    "e2el_mean": "ms",
    "request_throughput": "req/s",
}
SPEC_PATTERNS = (re.compile(r"^mtp:\s*(\d+)"), re.compile(r"steps(\d+)"))
LENGTH_PATTERN = re.compile(r"(?:mean )?acceptance length (\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class Row:
    number: int
    fields: dict[str, str]

    @property
    def label(self) -> str:
        f = self.fields
        return (
            f"{f['model']} {f['hardware']} x{f['gpus']} {f['engine']} {f['weights'][:10]} {f['input_len']}/"
            f"{f['output_len']} c={f['concurrency']} {f['metric']} ({f['spec']})"
        )


@dataclass(frozen=True)
class Comparison:
    row: Row
    published: float
    with_mtp: float | None = None
    without_mtp: float | None = None
    published_without: float | None = None  # the same setup's row without MTP, where the source gives one
    acceptance: str = ""
    why_not: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.with_mtp is None else self.with_mtp / self.published


def draft_tokens(spec: str) -> int | None:
    """K from the CSV's spec column: mtp:3, "mtp: NEXTN steps2 topk1 draft3" (SGLang's steps), mtp:3 (topk1)."""
    for pattern in SPEC_PATTERNS:
        found = pattern.search(spec)
        if found:
            return int(found.group(1))
    return None


def acceptance_from_note(note: str, spec: str, k: int) -> list[float]:
    """One rate a such that 1 + a + ... + a^K is the row's stated mean acceptance length ("~90% acceptance" with
    one draft is a = 0.9); empty when the row states none."""
    found = LENGTH_PATTERN.search(note)
    if found:
        length = float(found.group(1))
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            if 1 + sum(middle ** (i + 1) for i in range(k)) < length:
                low = middle
            else:
                high = middle
        return [round(low, 4)]
    percent = re.search(r"~(\d+)% acceptance", spec + " " + note)
    if percent and k == 1:
        return [int(percent.group(1)) / 100]
    return []


def why_not(row: Row) -> str:
    """Why the plan cannot express ROW (empty when it can)."""
    f = row.fields
    checks = (
        (f["spec"].startswith("simulated"), "an emulation of MTP, not a run"),
        (canonical_preset_name(f["model"]) is None and canonical_preset_name(f"deepseek-ai/{f['model']}") is None,
         f"no preset for {f['model']} yet"),
        (f["weights"] not in WEIGHTS, f"no weight format for {f['weights'][:30]!r}"),
        (f["hardware"] not in HARDWARE, f"no catalog entry for {f['hardware']}"),
        (not (f["input_len"] and f["output_len"] and f["concurrency"]), "lengths or concurrency not stated"),
        (f["metric"] not in METRICS, f"metric {f['metric']} is not one the plan predicts"),
        (f["spec"] != "none" and draft_tokens(f["spec"]) is None, f"draft count not read from {f['spec']!r}"),
        (bool(f.get("nodes")) and f.get("nodes") not in ("", "1"), "a deployment over several nodes"),
    )  # fmt: skip
    return next((reason for failed, reason in checks if failed), "")


def plan_config(row: Row, k: int | None, acceptance: list[float]) -> PlanConfig:
    f = row.fields
    model = canonical_preset_name(f["model"]) or canonical_preset_name(f"deepseek-ai/{f['model']}")
    tp = int(f["tp"]) if f["tp"] else int(f["gpus"])
    dp = int(f["dp"]) if f.get("dp") else 1
    return PlanConfig(
        model=model,
        gpu=HARDWARE[f["hardware"]],
        gpus=tp * dp,
        weights=WEIGHTS[f["weights"]],
        input_len=int(f["input_len"]),
        output_len=int(f["output_len"]),
        concurrency=[int(f["concurrency"])],
        tp=tp,
        dp=dp,
        ep=dp > 1,
        engine="sglang" if f["engine"] == "sglang" else "vllm",
        max_model_len=int(f["input_len"]) + int(f["output_len"]) + 64,
        speculative_method="mtp" if k else None,
        num_speculative_tokens=k,
        spec_acceptance=acceptance if k else [],
    )


def metric_value(prediction: Prediction, metric: str, gpus: int) -> float:
    e2el_s = prediction.e2el_ms / 1e3
    return {
        "output_throughput": prediction.output_throughput_tok_s,
        "output_throughput_per_gpu": prediction.output_throughput_tok_s / gpus,
        "output_throughput_per_user": prediction.output_throughput_tok_s / prediction.concurrency,
        "tpot_mean": prediction.tpot_ms,
        "ttft_mean": prediction.ttft_ms,
        "e2el": prediction.e2el_ms,
        "e2el_mean": prediction.e2el_ms,
        "request_throughput": prediction.running / e2el_s,
    }[metric]


def predict(row: Row, k: int | None, acceptance: list[float]) -> float:
    plan = make_plan(plan_config(row, k, acceptance))
    if not plan.predictions:
        raise DeepserveError("the plan finds no room for the model")
    return metric_value(plan.predictions[0], row.fields["metric"], plan.deployment.layout.gpus)


def compare(rows: list[Row]) -> list[Comparison]:
    without = {_setup(row): float(row.fields["value"]) for row in rows if row.fields["spec"] == "none"}
    comparisons = []
    for row in rows:
        f = row.fields
        if f["spec"] == "none":
            continue
        published = float(f["value"])
        reason = why_not(row)
        if reason:
            comparisons.append(Comparison(row, published, why_not=reason))
            continue
        k = draft_tokens(f["spec"])
        acceptance = acceptance_from_note(f["note"], f["spec"], k or 1)
        try:
            with_mtp, no_mtp = predict(row, k, acceptance), predict(row, None, [])
        except DeepserveError as exc:
            comparisons.append(Comparison(row, published, why_not=str(exc)[:100]))
            continue
        stated = f"a={acceptance[0]:g} (the row's)" if acceptance else "published default"
        comparisons.append(Comparison(row, published, with_mtp, no_mtp, without.get(_setup(row)), stated))
    return comparisons


def _setup(row: Row) -> tuple[str, ...]:
    f = row.fields
    keys = ("source", "hardware", "gpus", "engine", "model", "input_len", "output_len", "concurrency", "metric")
    return tuple(f[key] for key in keys)


def load_rows(path: Path = ROWS_PATH) -> list[Row]:
    with path.open(newline="") as handle:
        return [Row(number, fields) for number, fields in enumerate(csv.DictReader(handle), start=1)]


def table(comparisons: list[Comparison], markdown: bool, everything: bool) -> str:
    header = (
        "| row | setup | published | plan with MTP (ratio) | plan without MTP | published without MTP | "
        "gain published / plan | acceptance |"
    )
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|---|"]
    for c in comparisons:
        if c.with_mtp is None:
            continue
        assert c.without_mtp is not None
        gain_published = f"{_speedup(c, c.published, c.published_without):.2f}" if c.published_without else "-"
        gain_plan = f"{_speedup(c, c.with_mtp, c.without_mtp):.2f}"
        lines.append(
            f"| {c.row.number} | {c.row.label} | {_number(c.published)} | {_number(c.with_mtp)} ({c.ratio:.2f}) | "
            f"{_number(c.without_mtp)} | {_number(c.published_without)} | {gain_published} / {gain_plan} | "
            f"{c.acceptance} |"
        )
    expressed = [c for c in comparisons if c.with_mtp is not None]
    skipped: dict[str, int] = {}
    for c in comparisons:
        if c.with_mtp is None:
            skipped[c.why_not] = skipped.get(c.why_not, 0) + 1
    lines.append("")
    lines.append(f"{len(expressed)} of {len(comparisons)} MTP rows expressed; the others:")
    lines += [f"- {count} row(s): {reason}" for reason, count in sorted(skipped.items(), key=lambda kv: -kv[1])]
    if everything:
        lines += [f"  - row {c.row.number}: {c.row.label}: {c.why_not}" for c in comparisons if c.why_not]
    text = "\n".join(lines)
    return text if markdown else text.replace("| ", "").replace(" |", "  ")


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 1 else f"{value:.4f}"


def _speedup(c: Comparison, with_mtp: float, without_mtp: float) -> float:
    """MTP's speed-up in the row's metric: for latencies without / with, for rates with / without."""
    latency = c.row.fields["metric"].startswith(("e2el", "tpot", "ttft"))
    return without_mtp / with_mtp if latency else with_mtp / without_mtp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (docs/PLANNING.md)")
    parser.add_argument("--all", action="store_true", help="also list every row the plan cannot express")
    parser.add_argument("--rows", type=Path, default=ROWS_PATH, help="the CSV of published rows")
    args = parser.parse_args()
    print(table(compare(load_rows(args.rows)), args.markdown, args.all))


if __name__ == "__main__":
    main()
