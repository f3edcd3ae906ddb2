from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from deepserve.cli.plan_validate import _shape_summary, validation_markdown
from deepserve.errors import ConfigError
from deepserve.plan.benchmark import BenchmarkRun
from deepserve.plan.fit import fit_profiles, leave_one_source_out, row_cases
from deepserve.plan.formats import get_format
from deepserve.plan.kernels import KERNELS_PATH, WORK_KINDS
from deepserve.plan.phases import decode_rate
from deepserve.plan.profiles import MAX_FITTED, PROFILES_PATH, load_profiles, select_profile, version_in_range
from deepserve.plan.published import (
    FIGURES_PATH,
    ROWS_PATH,
    SCORED_KINDS,
    PublishedRow,
    RowMetric,
    benchmark_run,
    load_rows,
    parse_metric,
    row_deployment,
    row_speculation,
    unpredictable_reason,
)
from deepserve.plan.scoring import fits_steady, predict_row
from deepserve.plan.speculative import MTP_ACCEPTANCE_SOURCE
from deepserve.plan.validate import MAX_RATIO, Score, validate

# ../shared/published next to the checkout, or two levels up from a git worktree kept one folder deeper.
SHARED_CSV = next(
    (
        candidate
        for parent in Path(__file__).resolve().parents[3:6]
        if (candidate := parent / "shared" / "published" / "serving_figures.csv").is_file()
    ),
    Path("shared/published/serving_figures.csv"),
)


@pytest.fixture(scope="module")
def validation():
    """The steady-formula validation (seconds); tests/integration/plan runs the one with the simulator's forecasts."""
    return validate()


def test_packaged_figures_are_the_shared_csv() -> None:
    if not SHARED_CSV.is_file():
        pytest.skip("the shared calibration CSV is not next to this checkout")
    with SHARED_CSV.open() as handle:
        assert json.loads(FIGURES_PATH.read_text())["rows"] == list(csv.DictReader(handle))


def test_research_rows_keep_their_source_and_say_how_they_are_read() -> None:
    """Every collected row keeps its source; how the planner reads it (scored_as) is one of the known kinds; every
    filled-in field and every exclusion says why."""
    with ROWS_PATH.open() as handle:
        raw = list(csv.DictReader(handle))
    assert len(raw) == 382 and [int(r["row"]) for r in raw] == list(range(101, 483))
    for entry in raw:
        assert None not in entry, f"row {entry['row']}: more fields than columns (an unquoted comma in its text)"
        assert entry["source"] and entry["source_id"], entry["row"]
        assert entry["scored_as"] in (*SCORED_KINDS, "excluded"), entry["row"]
        if entry["scored_as"] == "excluded" or "[changed:" in entry["curation"]:
            assert len(entry["curation"]) > 20, entry["row"]
    tenstorrent = next(r for r in load_rows() if r.source_id == "tenstorrent-356-h100")
    assert tenstorrent.tp == 16 and "filled TP16" in tenstorrent.curation


def _read_metric(name: str, unit: str) -> RowMetric:
    metric = parse_metric(name, unit)
    assert metric is not None, f"{name} ({unit}) was not read as a metric"
    return metric


def _run_of(row: PublishedRow) -> BenchmarkRun:
    run = benchmark_run(row)
    assert run is not None, f"row {row.number} gave no benchmark run"
    return run


def test_metrics_are_read_as_what_they_are() -> None:
    assert _read_metric("total_throughput_per_gpu", "tok/s/gpu").per == "gpu"
    assert _read_metric("input_throughput_per_node", "tok/s/node").quantity == "input_throughput"
    assert _read_metric("ttft_p99", "ms").statistic == "p99" and _read_metric("ttft_p99", "ms").group == "p99"
    assert _read_metric("e2el_mean", "s").seconds and _read_metric("e2el", "ms").statistic == "mean"
    assert _read_metric("itl_median", "ms").group == "tpot"
    assert parse_metric("peak_output_throughput", "tok/s") is None
    rows = {r.number: r for r in load_rows()}
    assert _run_of(rows[421]).request_rate == 10 and _run_of(rows[421]).num_prompts == 50
    assert _run_of(rows[220]).num_prompts == 40  # InferenceX: ten requests per client


def test_a_client_default_request_count_makes_an_unstated_run_finite() -> None:
    """Seed 002's client is `vllm bench serve` with no --num-prompts: its default 1000 requests, all clients
    starting together, at every concurrency (at 1024 clients that is fewer requests than clients, not a steady
    loop); a source without such a default keeps the long-run shape."""
    rows = {r.number: r for r in load_rows()}
    assert rows[18].concurrency == 1024 and _run_of(rows[18]).num_prompts == 1000
    assert _run_of(rows[18]).warmup_requests == 0 and _run_of(rows[4]).num_prompts == 1000
    seed_001 = _run_of(rows[21])  # its own client, count unstated: seven rounds with the first left out
    assert seed_001.num_prompts == 7 * 15 and seed_001.warmup_requests == 15


def test_a_weights_column_that_describes_its_format_is_read_by_the_formats_name() -> None:
    """SGLang's V4 cookbook rows say 'fp4 (DeepSeek release: MXFP4 experts + FP8)': the name before the parenthesis
    is the format (fp4 -> the release's MXFP4 experts), so the rows are planned on V4's presets, with the
    cookbook's client (bench_serving's default range ratio: lengths uniform in [1, L], mean L / 2)."""
    rows = {r.number: r for r in load_rows()}
    flash_b200 = rows[281]
    assert flash_b200.weight_format == "fp4" and unpredictable_reason(flash_b200) is None
    case = next(c for c in row_cases([flash_b200])[0])
    assert case.deployment.fmt.name == "mxfp4" and case.deployment.spec.name.endswith("DeepSeek-V4-Flash")
    assert _run_of(flash_b200).num_prompts == 32 and _run_of(flash_b200).input_len == 4096
    gb200_nvfp4 = rows[next(n for n, r in rows.items() if r.weights.startswith("nvfp4-moe"))]
    assert unpredictable_reason(gb200_nvfp4) is None and get_format(gb200_nvfp4.weight_format).name == "nvfp4"


def test_sglang_rows_without_a_stated_chunk_run_at_sglangs_own_default_for_their_gpu() -> None:
    """SGLang sizes --chunked-prefill-size by the GPU's memory where the command sets none (the V4 cookbook's cells
    set none): 16,384 on a B200, 8,192 on an H200; InferenceX's stated 32,768 stands; vLLM's rows keep 8,192."""
    rows = {r.number: r for r in load_rows()}
    cookbook = [r for r in rows.values() if r.source_id == "sglang-v4-cookbook"]
    h200_cell = next(r for r in cookbook if r.hardware.startswith("H200"))
    budgets = [row_deployment(row).max_num_batched_tokens for row in (rows[287], rows[196], rows[1], h200_cell)]
    assert budgets == [16384, 32768, 8192, 8192]
    balanced = row_deployment(rows[287])  # tp4 dp4 with DP attention: each rank prefills a quarter
    assert balanced.layout.dp == 4 and balanced.prefill_tokens_per_rank_step == 4096


def test_an_mtp_run_without_a_stated_acceptance_takes_the_plans_default() -> None:
    """What `plan --speculative-method mtp` assumes when the user gives no acceptance: the published default;
    a source that states its acceptance length keeps its own."""
    rows = {r.number: r for r in load_rows()}
    unstated = row_speculation(rows[281])  # the cookbook's EAGLE/MTP 3-1-4: three drafts, acceptance not given
    assert unstated is not None and unstated.num_tokens == 3
    assert unstated.acceptance_source == MTP_ACCEPTANCE_SOURCE
    mtp_blog = next(r for r in rows.values() if r.source_id == "lmsys-mtp-h200" and r.spec.startswith("mtp:"))
    stated = row_speculation(mtp_blog)
    assert stated is not None and stated.acceptance_source == "lmsys-mtp-h200"


def test_pr_5571_runs_sglangs_triton_fp8_gemm_as_its_deepgemm_off_launch_forces() -> None:
    """SGLang PR 5571's run set SGL_ENABLE_JIT_DEEPGEMM=0: its dense GEMMs run at Triton's fractions; InferenceX's
    H200 run, with DeepGEMM on, at DeepGEMM's."""
    cases = {c.row.number: c for c in row_cases()[0]}
    assert cases[421].deployment.options.dense_gemm_backend == "triton"
    assert cases[421].rates.rate("dense_gemm").compute_efficiency == pytest.approx(0.30)
    assert cases[196].rates.rate("dense_gemm").compute_efficiency == pytest.approx(0.53)


def test_gb200_decode_on_twelve_trays_exchanges_tokens_over_the_racks_nvlink() -> None:
    """LMSYS's 48-GPU decode ran on 12 trays of one NVL72 rack: one NVLink domain, not 12 machines over the network;
    each rank decodes the 1,408 sequences the blog states where its cache holds them, else what it holds."""
    cases = {c.row.number: c for c in row_cases()[0]}
    for number in (107, 109, 111):
        deployment = cases[number].deployment
        links = cases[number].model(cases[number].engine.parameters).links
        assert deployment.nodes == 1 and deployment.hosts == 12
        assert links.experts.kind == "nvlink5" and links.expert_nodes == 1
    fp8_cache, bf16_cache = cases[109].deployment, cases[111].deployment
    assert fp8_cache.running_cap / 48 > 1408 > bf16_cache.running_cap / 48
    for number, batch in ((109, 1408), (111, bf16_cache.running_cap / 48)):
        case = cases[number]
        rate = decode_rate(case.model(case.engine.parameters), 2000, batch).tokens_per_s_per_gpu
        predicted = predict_row(case.row, case.deployment, case.model(case.engine.parameters))
        assert predicted == pytest.approx(rate, rel=1e-3)  # at the prompt plus half the output the row assumes


def test_trtllm_memory_fraction_is_of_the_memory_the_weights_leave() -> None:
    """TensorRT-LLM's free_gpu_memory_fraction gives the KV cache that share of what the weights and the engine's
    reserve leave: InferenceX's B200 TP4 runs (157.5 GiB of FP8 weights per 180 GiB GPU) keep 0.8 of the rest for
    the cache, where vLLM's meaning (0.9 of the whole GPU) would leave under 1 GiB and queue 16 clients."""
    cases = {c.row.number: c for c in row_cases()[0]}
    for number in (465, 158):  # B200 TP4 at 16 clients; the H200 guide's DP8 + EP8
        memory = cases[number].deployment.memory
        device = cases[number].deployment.accelerator.memory_bytes
        left = device - memory.weights_bytes_per_gpu - memory.reserve_bytes_per_gpu
        assert memory.kv_cache_bytes_per_gpu == pytest.approx(0.8 * left, rel=1e-6)
    assert cases[465].deployment.memory.kv_cache_bytes_per_gpu > 10 * 1024**3
    assert cases[465].deployment.running_cap >= 16


def test_seed_002_decodes_on_the_mla_kernel_its_block_size_forces() -> None:
    """Seed 002 launches vLLM with --block-size 1, which on Blackwell only the Triton MLA backend accepts: its rows
    read the latent cache at Triton's measured fraction, a source without such a flag at FlashMLA's."""
    cases = {c.row.number: c for c in row_cases()[0]}
    assert cases[17].deployment.options.mla_decode_backend == "triton"
    assert cases[17].rates.rate("mla_decode").memory_efficiency == pytest.approx(0.27)
    assert cases[21].rates.rate("mla_decode").memory_efficiency == pytest.approx(0.90)  # seed 001, H100


def test_trtllm_rows_not_scored_are_listed_with_the_reason(validation) -> None:
    """TensorRT-LLM is an engine deepserve launches (engines/trtllm.py): its rows are scored where the planner can
    express them, the others say why not."""
    trtllm = [s for s in validation.skipped if s.row.engine == "trtllm"]
    assert trtllm and all(s.reason for s in trtllm)
    assert any(r.row.engine == "trtllm" for r in validation.held_out.results)


def test_leave_one_source_out_is_the_headline_and_every_source_is_held_out(validation) -> None:
    """Each source predicted by profiles fitted on the other sources only; the closed-loop NVIDIA rows stay within
    the errors measured when this was written (docs/PLANNING.md section 6), a guard against regressions."""
    held = validation.held_out
    assert {r.provenance for r in held.results} == {"leave-one-source-out"}
    assert len({r.row.source_id for r in held.results}) >= 8
    headline = held.headline
    assert len(headline.results) >= 80
    assert headline.mape_pct("throughput") <= 30 and headline.mape_pct("tpot") <= 30


def test_held_out_predictions_do_not_use_their_own_source() -> None:
    """Refitting without a source must change the parameters that predict it (else the split is not real)."""
    cases = row_cases()[0]
    everything = {fit.profile: fit.parameters for fit in fit_profiles(cases)}
    by_source = {}
    for held in leave_one_source_out(cases):
        case = next(c for c in cases if c.row.number == held.row.number)
        if not case.engine.engine.fitted:  # a profile with nothing fitted has no split to make
            continue
        if held.parameters is not None and any(c.steady for c in cases if c.row.source == held.row.source):
            by_source[held.row.source] = (held.parameters, everything[case.engine.profile])
    assert by_source
    for source, (held_parameters, full) in by_source.items():
        assert held_parameters != full, source


def test_in_sample_is_shown_second_and_is_no_worse(validation) -> None:
    data = validation.to_json()
    assert list(data)[:2] == ["leave_one_source_out", "in_sample"]
    assert validation.in_sample.headline.mape_pct() <= validation.held_out.headline.mape_pct() + 1e-9
    assert data["mape_pct"] == data["in_sample"]["mape_pct"]  # the key earlier scripts read
    assert set(data["leave_one_source_out"]["by_layout_kind"]) >= {"tp", "dp-attention+ep", "tp+pp"}


def test_score_arithmetic_by_hand(validation) -> None:
    first, second = validation.held_out.results[:2]
    score = Score((first, second))
    expected = (abs(first.ratio - 1) + abs(second.ratio - 1)) / 2 * 100
    assert score.mape_pct() == pytest.approx(expected)
    assert score.breakdown(lambda r: "all")["all"][first.group][1] == sum(
        r.group == first.group for r in (first, second)
    )


def test_a_profile_with_a_bad_prefill_chunk_divisor_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    data = json.loads(PROFILES_PATH.read_text())
    sglang = data["profiles"]["sglang"]["versions"][-1]
    assert sglang["dp_attention_prefill_chunk"]["divide_by"] == "dp"
    sglang["dp_attention_prefill_chunk"]["divide_by"] = "half"
    path = tmp_path / "engine_profiles.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="divide_by is 'half'; give \"dp\""):
        load_profiles(path)


def test_stored_parameters_are_what_the_fit_produces() -> None:
    """No hand-tuned numbers: refitting from the published rows reproduces the stored parameters."""
    stored = load_profiles()
    for fit in fit_profiles():
        for name in fit.fitted:
            assert getattr(fit.parameters, name) == pytest.approx(
                getattr(stored[fit.profile].parameters, name), rel=0.02
            )


def test_fitted_parameters_have_priors_with_sources_and_their_inputs() -> None:
    data = json.loads(PROFILES_PATH.read_text())
    for name, profile in data["profiles"].items():
        assert len(profile["fitted"]) <= MAX_FITTED, name
        for parameter in profile["parameters"].values():
            assert parameter["about"]
        if profile["device"] != "cpu":
            for key in profile["fitted"]:
                prior = profile["parameters"][key]["prior"]
                assert prior["value"] > 0 and prior["factor"] > 1 and prior["source"], (name, key)
    gpu = data["profiles"]["vllm"]
    assert gpu["fit"]["rows"] and gpu["fit"]["catalog"] and gpu["fit"]["values"]


def test_every_kernel_figure_has_a_source_and_a_sane_value() -> None:
    table = json.loads(KERNELS_PATH.read_text())
    for name, entry in table["classes"].items():
        for kind in WORK_KINDS:
            for family, figures in entry[kind].items():
                where = f"{name}/{kind}/{family}"
                assert figures["source"], where
                assert 0 < figures["memory_efficiency"] <= 1 and 0 < figures["compute_efficiency"] <= 1, where
                assert figures.get("floor_us", 0) >= 0, where
    for mode, launch in table["launch_us"].items():
        assert launch["value"] > 0 and launch["source"], mode
    for kind, figures in table["collectives"].items():
        assert figures["source"], kind


def test_amd_kernel_figures_are_sourced_not_carried_over() -> None:
    """Issue 20: CDNA3's and CDNA4's kernels measured or sourced (AITER's tables at DeepSeek's shapes), not carried
    over; AMD's small GEMMs take microseconds however small, so decode-size FP8 GEMMs read far less than NVIDIA's."""
    table = json.loads(KERNELS_PATH.read_text())["classes"]
    for name in ("cdna3", "cdna4"):
        entry = table[name]
        assert entry["measured"] is True and "aiter" in entry["measured_on"].lower()
        for kind, family in (("dense_gemm", "fp8"), ("mla_decode", "any"), ("mla_prefill", "any")):
            assert entry[kind][family].get("measured", True), f"{name}/{kind}/{family}"
        assert (
            entry["dense_gemm"]["fp8"]["memory_efficiency"] < table["hopper"]["dense_gemm"]["fp8"]["memory_efficiency"]
        )
    assert table["cdna4"]["moe_gemm"]["fp4"].get("measured", True) and table["cdna4"]["dense_gemm"]["fp4"].get(
        "measured", True
    )


def test_every_row_is_either_predicted_or_explained(validation) -> None:
    seen = {r.row.number for r in validation.in_sample.results} | {s.row.number for s in validation.skipped}
    seen |= {s.row.number for s in validation.not_held_out}
    assert seen == {row.number for row in load_rows()}
    by_number = {row.number: row for row in load_rows()}
    for skipped in validation.skipped:
        assert skipped.reason
        row = by_number[skipped.row.number]
        if row.source.startswith("004_") and row.parsed_metric and row.parsed_metric.group == "throughput":
            assert "output or all tokens" in skipped.reason  # seed 004's "tokens/s" does not say which tokens
        if row.input_len is None and row.scored_as != "excluded":
            assert "not given" in skipped.reason
    for skipped in validation.not_held_out:  # without the simulator, a finite run cannot be predicted
        assert skipped.row.scored_as in ("finite", "closed_loop") and "simulator" in skipped.reason


def test_rows_on_hardware_without_measured_kernel_figures_are_explained_not_scored() -> None:
    """A GPU class whose kernel figures are carried over (Ada here) must not stand in for measurements: its rows
    are explained, with the carried-over prediction shown for information."""
    row = next(r for r in load_rows() if r.number == 1)
    ada = replace(row, number=9001, hardware="l40s", gpus=16, tp=8, pp=2, weights="awq-int4", source="x")
    assert unpredictable_reason(ada) is None
    result = validate(rows=[*load_rows()[:27], ada])
    skipped = next(s for s in result.skipped if s.row.number == 9001)
    assert "no measured kernel figures for ada" in skipped.reason


def test_each_trtllm_source_is_predicted_by_a_profile_fitted_on_the_other() -> None:
    """TensorRT-LLM's profile is fitted on its two sources (NVIDIA's DeepSeek-R1 guide on H200, InferenceX's B200
    sweep): leaving either out, the other alone fits it, so the held-out source's rows are predicted by
    parameters that differ from the full fit; the rows the steady formula describes (throughputs, TPOT) within a
    factor 1.5 of what each source measured."""
    cases = row_cases()[0]
    trtllm = [c for c in cases if c.engine.profile == "trtllm"]
    assert {c.row.source_id for c in trtllm} == {"trtllm-best-perf", "inferencex-3317-b200-trt"}
    full = next(f for f in fit_profiles(cases) if f.profile == "trtllm")
    assert full.fitted == ("kernels_per_layer", "prefill_efficiency")
    held = [h for h in leave_one_source_out(cases) if h.row.engine == "trtllm" and h.parameters is not None]
    assert {h.row.source_id for h in held} == {"trtllm-best-perf", "inferencex-3317-b200-trt"}
    for result in held:
        assert result.parameters != full.parameters, result.row.label()
        if fits_steady(result.row):
            assert 1 / 1.5 <= result.ratio <= 1.5, result.row.label()


def test_profile_selection_and_versions() -> None:
    profiles = load_profiles()
    vllm = select_profile("vllm", "hopper", "0.7.3", profiles)
    assert vllm is not None and vllm.profile == "vllm" and vllm.provenance.startswith("fitted")
    assert vllm.facts.range == "<0.8" and vllm.facts.max_num_seqs_per_micro_batch and not vllm.facts.mixed_prefill
    current = select_profile("vllm", "hopper", None, profiles)
    assert current is not None and current.facts.range == ">=0.8"
    on_cpu = select_profile("vllm", "cpu", None, profiles)
    assert on_cpu is not None and on_cpu.profile == "vllm-cpu"
    sglang = select_profile("sglang", "hopper", None, profiles)
    assert sglang is not None and sglang.profile == "sglang" and not sglang.facts.mixed_prefill
    old = select_profile("sglang", "hopper", "0.4.3", profiles)
    assert old is not None and old.facts.step_overhead_ms > 0 and "2643" in old.facts.source
    rocm = select_profile("sglang", "cdna3", None, profiles)
    assert rocm is not None and rocm.profile == "sglang-rocm" and rocm.facts.range == ">=0.5"
    rocm_0_4 = select_profile("sglang", "cdna3", "0.4.10.post1", profiles)
    assert rocm_0_4 is not None and rocm_0_4.facts.step_overhead_ms == 20.0 and "dstack" in rocm_0_4.facts.source
    cpu = select_profile("sglang", "cpu", None, profiles)  # SGLang has no CPU profile: vLLM's CPU one stands in
    assert cpu is not None and cpu.profile == "vllm-cpu" and cpu.provenance.startswith("transferred")
    assert select_profile("sglang", "cpu", None, profiles, across_engines=False) is None
    trtllm = select_profile("trtllm", "hopper", None, profiles, across_engines=False)
    assert trtllm is not None and trtllm.provenance.startswith("fitted") and trtllm.facts.launch == "cuda_graph"
    assert version_in_range("0.16.0", ">=0.8") and version_in_range("0.7.3", "<0.8")
    assert not version_in_range("0.10.1", "<0.8")  # numeric, not string, comparison


def test_cpu_profile_is_what_its_stored_measurements_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU profile's overheads come from benchmarks/cpu_profile.py's measured points (their steady parts),
    stored with them: refitting those points reproduces them."""
    from deepserve.plan.fit import fit_parameters
    from tests.helpers import load_benchmark_script

    module = load_benchmark_script("cpu_profile", monkeypatch)
    stored = json.loads(PROFILES_PATH.read_text())["profiles"]["vllm-cpu"]
    points = [module.Point(**p) for p in stored["fit"]["points"]]
    chosen = [p.in_steady_state() for p in points if [p.concurrency, p.input_len] in stored["fit"]["calibration"]]
    output_len = stored["fit"]["output_len"]
    base = module.deployment_for(chosen[0], output_len).select_engine(across_engines=False)
    fit = fit_parameters(base, module.targets(chosen, output_len))
    for name in stored["fitted"]:
        assert getattr(fit.parameters, name) == pytest.approx(stored["parameters"][name]["value"], rel=0.02)


def test_off_by_more_than_2x_is_counted_on_every_row(validation) -> None:
    off = validation.held_out.off_by_more_than_2x
    assert all(not 1 / MAX_RATIO <= r.ratio <= MAX_RATIO for r in off)


def test_a_forecast_closed_loop_shows_the_steady_formula_beside_it_and_where_they_part(validation) -> None:
    """`plan validate` puts the steady figure next to a closed loop it forecast; the summary names the rates and
    latencies past the first token where the two part by more than 1.25x (not first-token times, which only the
    forecast describes beyond one client)."""
    by_group = {r.group: r for r in validation.held_out.results if r.row.scored_as == "closed_loop"}
    throughput, ttft, tpot = by_group["throughput"], by_group["ttft"], by_group["tpot"]
    parted = replace(throughput, steady=throughput.predicted * 1.5)
    first_token = replace(ttft, steady=ttft.predicted * 3)
    close = replace(tpot, steady=tpot.predicted * 1.2)
    summary = _shape_summary(Score((parted, first_token, close)))
    assert f"row {parted.row.number} ({parted.ratio:.2f} forecast, {parted.steady_ratio:.2f} steady)" in summary
    assert f"row {first_token.row.number} " not in summary and f"row {close.row.number} " not in summary
    assert parted.steady_ratio == pytest.approx(1.5 * parted.ratio)
    assert _shape_summary(Score((close,))).endswith(": none")
    assert "none was forecast" in _shape_summary(validation.held_out)  # the steady-only validation
    assert validation.to_json()["leave_one_source_out"]["rows"][0].keys().isdisjoint({"steady_predicted"})
    text = validation_markdown(replace(validation, held_out=Score((parted, close))))
    assert f"| {parted.steady:,.4g} | {parted.steady_ratio:.2f} |" in text
