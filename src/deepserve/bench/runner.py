"""One benchmark run, end to end: check the target (server_check.py), build the workload, decide the token-ids probe,
encode the run (drive_plan.py), send it from this process (driver.py) or from worker processes (workers.py) while the
server's metrics are sampled (server_metrics.py) and its profiler runs (profiler.py), then turn what arrived into
records and the result."""

from __future__ import annotations

from datetime import datetime

from deepserve.bench.attribution import attribution_counts, overall_attribution
from deepserve.bench.config import BenchConfig
from deepserve.bench.drive_plan import DrivePlan, make_drive_plan, request_id_prefix
from deepserve.bench.driver import DriveOutcome, Driver, raise_open_files_limit, run_async
from deepserve.bench.output import BenchResult, save_result
from deepserve.bench.profiler import Profiler
from deepserve.bench.progress import LiveCounters, ProgressDisplay
from deepserve.bench.records import finish_records, output_source
from deepserve.bench.server_check import BenchError, check_server
from deepserve.bench.server_metrics import ServerMetricsSummary, scraper_for
from deepserve.bench.token_ids import decide_token_ids
from deepserve.bench.tokenizer import TokenCounter, TokenizerOptions, load_token_counter
from deepserve.bench.workers import drive_in_workers
from deepserve.bench.workloads import Workload, build_workload

__all__ = ["BenchError", "BenchResult", "check_server", "run_benchmark", "run_workload", "save_result"]


def run_benchmark(config: BenchConfig, display: bool = True) -> BenchResult:
    """Run CONFIG's benchmark and return the result (partial and marked incomplete after Ctrl-C)."""
    target, workload_config = config.target, config.workload
    model = check_server(config)
    counter = load_token_counter(
        workload_config.tokenizer,
        target.root_url,
        model,
        target.resolved_api_key(),
        TokenizerOptions(
            served_model=target.request_model(model),
            mode=workload_config.tokenizer_mode,
            trust_remote_code=workload_config.trust_remote_code,
            server_only=workload_config.skip_tokenizer_init,
            verify_tls=not target.insecure,
            chat_template_kwargs=target.template_kwargs(),
            endpoint_url=target.url,
            exact_lengths=workload_config.exact_prompt_lengths,
        ),
    )
    workload = build_workload(workload_config, counter, target.chat)
    if config.metrics.num_runs == 1:
        return run_workload(config, model, workload, counter, display)
    return run_repeatedly(config, model, workload, counter, display)


def run_repeatedly(
    config: BenchConfig, model: str, workload: Workload, counter: TokenCounter | None, display: bool = True
) -> BenchResult:
    """--num-runs N: the same requests sent N times, one run after the other; the result holds each run and their
    means with confidence intervals (repeats.py). Ctrl-C ends the series with the runs so far (marked incomplete)."""
    runs: list[BenchResult] = []
    for number in range(1, config.metrics.num_runs + 1):
        result = run_workload(_run_config(config, number), model, workload, counter, display)
        for record in result.records:
            record.run = number
        runs.append(result)
        if result.incomplete:
            break
    return BenchResult.of_runs(config, runs)


def _run_config(config: BenchConfig, number: int) -> BenchConfig:
    """Run NUMBER's config: a --request-id-prefix gets the run's number, so no request id is sent twice."""
    prefix = config.target.request_id_prefix
    if prefix is None:
        return config
    return config.model_copy(
        update={"target": config.target.model_copy(update={"request_id_prefix": f"{prefix}run{number}-"})}
    )


def run_workload(
    config: BenchConfig, model: str, workload: Workload, counter: TokenCounter | None, display: bool = True
) -> BenchResult:
    """Send WORKLOAD (already built) to the checked target. COUNTER counts output tokens when the server sends
    no usage; without one, one token per chunk is assumed (and the records say so). Whether to ask for each
    chunk's token ids is decided first, with one probe request (token_ids.py)."""
    if not workload.requests and not workload.conversations:
        raise BenchError("the workload has no requests; check --num-prompts and the dataset")
    prefix = request_id_prefix(config.target)
    token_ids = decide_token_ids(config.target, model, f"{prefix}probe")
    plan = make_drive_plan(config, model, workload, prefix, token_ids.send)
    raise_open_files_limit()
    started_at = datetime.now()
    outcome, server, profile = run_async(_measure(config, plan, display))
    records = finish_records(outcome.records, outcome.uncounted, counter)
    return BenchResult(
        config=config,
        model_id=model,
        records=records,
        duration_s=outcome.end_s,
        server=server,
        workload_definition=workload.definition,
        tokenizer_source=workload.tokenizer_source,
        output_tokens_source=output_source(records),
        token_attribution=overall_attribution(records),
        token_attribution_requests=attribution_counts(records),
        token_ids=token_ids,
        turns_not_sent=outcome.turns_not_sent,
        incomplete=outcome.interrupted,
        warmups_done=outcome.warmups_done,
        started_at=started_at,
        clock_origin_s=outcome.clock_origin_s,
        profile=profile,
    )


async def _measure(
    config: BenchConfig, plan: DrivePlan, display: bool
) -> tuple[DriveOutcome, ServerMetricsSummary, str | None]:
    profiler = Profiler(config) if config.metrics.profile else None
    before_run = profiler.start if profiler is not None else None
    scraper = scraper_for(config)
    if scraper is not None:
        await scraper.start()
    workers = config.load.num_workers
    counters = LiveCounters.shared(workers) if workers > 1 else LiveCounters.local()
    total = plan.expected_records
    try:
        async with ProgressDisplay(counters, total, plan.duration_s, display and not config.output.disable_tqdm):
            if workers > 1:
                outcome = await drive_in_workers(plan, workers, counters, before_run)
            else:
                on_in_flight = scraper.client_in_flight if scraper is not None else None
                outcome = await Driver(plan, counters, 0, before_run=before_run, on_in_flight=on_in_flight).run()
    finally:  # whatever happened to the run, a profiler we started is stopped, and the scraper's client closed
        profile = await profiler.stop() if profiler is not None else None
        server = await scraper.stop() if scraper is not None else ServerMetricsSummary(False, "disabled")
    return outcome, server, profile
