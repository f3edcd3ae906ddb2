"""Each published row as a prediction: the quantity its metric names, computed the way its run was made.

- closed-loop and sweep-peak rows: the steady closed-loop formula (perf.closed_loop); when the run's number of
  requests is known and a forecaster is at hand, the finite run it was (the formula stays beside it);
- finite rows (a request rate, everything at once): only the forecaster's run of the same requests;
- phase rows: the prefill or decode pool alone (plan/phases.py).

The fit uses the formula (`steady=True`): it is fast and it is what the parameters mean; validation scores what
the user would have measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.plan.benchmark import BenchmarkForecast, BenchmarkForecaster
from deepserve.plan.perf import PerformanceModel, Prediction
from deepserve.plan.phases import decode_rate, prefill_rate
from deepserve.plan.published import GPUS_PER_NODE, PublishedRow, RowMetric, benchmark_run, row_workload
from deepserve.plan.types import Deployment


class NeedsForecaster(Exception):
    """A row whose run only a finite-benchmark forecast can reproduce, asked for without a forecaster."""


@dataclass(frozen=True)
class Measures:
    """What a prediction offers to read a metric from (one of the three)."""

    prediction: Prediction | None = None
    forecast: BenchmarkForecast | None = None
    phase_tokens_per_s_per_gpu: float | None = None


def fits_steady(row: PublishedRow) -> bool:
    """Whether the steady formula describes ROW's figure (the fit uses only such rows): not a finite run, not a
    tail, and a first-token time only for one client (beyond one, clients of equal lengths move in waves that
    only the forecast reproduces: docs/PLANNING.md section 9)."""
    metric = row.parsed_metric
    if row.scored_as not in ("closed_loop", "sweep_peak", "prefill_phase", "decode_phase") or metric is None:
        return False
    if metric.statistic == "p99":
        return False
    return metric.quantity != "ttft" or (row.concurrency or 0) == 1


def predict_row(
    row: PublishedRow,
    deployment: Deployment,
    model: PerformanceModel,
    forecaster: BenchmarkForecaster | None = None,
    steady: bool = False,
) -> float:
    """The model's value for ROW's metric (STEADY: the formula even where a finite run is known)."""
    metric = row.parsed_metric
    assert metric is not None
    return read_metric(row, metric, measure(row, deployment, model, forecaster, steady), deployment)


def measure(
    row: PublishedRow,
    deployment: Deployment,
    model: PerformanceModel,
    forecaster: BenchmarkForecaster | None,
    steady: bool,
) -> Measures:
    if row.scored_as in ("prefill_phase", "decode_phase"):
        return Measures(phase_tokens_per_s_per_gpu=_phase_rate(row, deployment, model))
    run = benchmark_run(row)
    if row.scored_as == "finite" or (run is not None and forecaster is not None and not steady):
        if forecaster is None or run is None:
            raise NeedsForecaster(row.label())
        return Measures(forecast=forecaster.forecast(deployment, model, run))
    return Measures(prediction=_steady(row, deployment, model))


def _steady(row: PublishedRow, deployment: Deployment, model: PerformanceModel) -> Prediction:
    """At the row's concurrency; the best of the source's concurrency sweep; at saturation for a request-rate
    sweep's peak."""
    workload = row_workload(row)
    cap = deployment.running_cap
    if row.concurrency is not None:
        return model.predict(row.concurrency, workload, cap)
    sweep = row.setup.concurrency_sweep
    if sweep:
        return max((model.predict(c, workload, cap) for c in sweep), key=lambda p: p.output_throughput_tok_s)
    return model.predict(cap, workload, cap)  # a request-rate sweep peaks when the batch is full


def _phase_rate(row: PublishedRow, deployment: Deployment, model: PerformanceModel) -> float:
    workload = row_workload(row)
    setup = row.setup
    if row.scored_as == "prefill_phase":
        tokens = setup.prefill_tokens_per_gpu or (row.concurrency or 1) * workload.input_len / row.gpus
        return prefill_rate(model, workload.input_len, tokens).tokens_per_s_per_gpu
    context = workload.input_len + workload.output_len / 2
    held = deployment.running_cap / deployment.layout.gpus  # a decode batch is at most what the KV cache holds
    sequences = min(setup.decode_batch_per_gpu, held) if setup.decode_batch_per_gpu else held
    return decode_rate(model, context, sequences).tokens_per_s_per_gpu


def read_metric(row: PublishedRow, metric: RowMetric, measures: Measures, deployment: Deployment) -> float:
    value = _quantity(row, metric, measures)
    if metric.per == "gpu":
        value /= row.gpus
    elif metric.per == "node":
        value /= max(row.gpus / GPUS_PER_NODE, 1)
    return value / 1e3 if metric.seconds and metric.quantity != "duration" else value


def _quantity(row: PublishedRow, metric: RowMetric, measures: Measures) -> float:
    if measures.phase_tokens_per_s_per_gpu is not None:
        return measures.phase_tokens_per_s_per_gpu * row.gpus  # the row's per-GPU or per-node divides it back
    if measures.forecast is not None:
        return _from_forecast(metric, measures.forecast)
    assert measures.prediction is not None
    return _from_prediction(row, metric, measures.prediction)


def _from_prediction(row: PublishedRow, metric: RowMetric, p: Prediction) -> float:
    w = row_workload(row)
    output = p.output_throughput_tok_s
    by_quantity = {
        "output_throughput": output,
        "total_throughput": output * (w.input_len + w.output_len) / w.output_len,
        "input_throughput": output * w.input_len / w.output_len,
        "request_throughput": output / w.output_len,
        "tpot": p.tpot_ms,
        "itl": p.tpot_ms,
        "ttft": p.ttft_ms,
        "e2el": p.e2el_ms,
        "per_user": 1e3 / p.tpot_ms,
        "duration": (row.num_prompts or p.concurrency) * w.output_len / output,
    }
    return by_quantity[metric.quantity]


def _from_forecast(metric: RowMetric, f: BenchmarkForecast) -> float:
    statistic = metric.statistic
    by_quantity = {
        "output_throughput": lambda: f.output_throughput_tok_s,
        "total_throughput": lambda: f.output_throughput_tok_s + f.input_throughput_tok_s,
        "input_throughput": lambda: f.input_throughput_tok_s,
        "request_throughput": lambda: f.request_throughput,
        "tpot": lambda: f.tpot_ms.get(statistic),
        "itl": lambda: f.itl_ms.get(statistic),
        "ttft": lambda: f.ttft_ms.get(statistic),
        "e2el": lambda: f.e2el_ms.get(statistic),
        "per_user": lambda: 1e3 / f.tpot_ms.mean,
        "duration": lambda: f.duration_s,
    }
    return float(by_quantity[metric.quantity]())
