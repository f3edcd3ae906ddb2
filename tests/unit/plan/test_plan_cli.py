from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.cli import main as cli_main
from deepserve.plan.calibration import CALIBRATION_FORMAT

AWQ = "cognitivecomputations/DeepSeek-V3-AWQ"


@pytest.fixture(autouse=True)
def only_plan_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real entry point, with only this sub-command registered (other commands are not under test here)."""
    monkeypatch.setattr(cli_main, "COMMANDS", ("plan",))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_promised_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", AWQ, "--gpu", "H100", "--gpus", "8", "--concurrency", "1,4,16", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] is True
    assert plan["kv_bytes_per_token"] == 70_272
    assert isinstance(plan["weights_bytes_per_gpu"], int) and 42e9 < plan["weights_bytes_per_gpu"] < 55e9
    assert plan["kv_cache_tokens"] > 100_000
    assert [p["concurrency"] for p in plan["predictions"]] == [1, 4, 16]
    for p in plan["predictions"]:
        assert {"concurrency", "output_throughput_tok_s", "tpot_ms", "ttft_ms"} <= p.keys()
        assert p["output_throughput_tok_s"] > 0 and p["tpot_ms"] > 0 and p["ttft_ms"] > 0
    assert plan["weights_by_component"]["attention_latent"]["placement"] == "replicated"
    assert "--tensor-parallel-size 8" in plan["commands"]["vllm"]
    assert "--tp-size 8" in plan["commands"]["sglang"]


def test_a_plan_says_how_far_forecasts_of_its_layout_have_been(capsys: pytest.CaptureFixture[str]) -> None:
    """The held-out track record of the plan's layout kind (plan/track_record.py), in JSON and in the table."""
    _code, out, _ = run(capsys, "--gpu", "h200", "--tp", "1", "--dp", "8", "--ep", "--json")
    record = json.loads(out)["track_record"]
    assert (record["layout_kind"], record["vendor"], record["attention"]) == ("dp-attention+ep", "nvidia", "mla")
    throughput = record["metrics"]["throughput"]
    assert throughput["figures"] >= 5 and throughput["low_ratio"] <= throughput["median_ratio"]
    _code, out, _ = run(capsys, "--gpu", "h200", "--tp", "1", "--dp", "8", "--ep")
    scope = "(dp-attention+ep on MLA models (V3, R1, V3.1), nvidia GPUs)"
    assert f"track record: predicted / published on runs it never saw {scope}" in out


def test_the_model_line_names_the_per_request_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    """What the engine adds besides the kernels, as the profile has it: on a GPU the small kernels and the
    per-request time before the first token (part of every TTFT the table prints)."""
    from deepserve.plan.profiles import load_profiles

    request_ms = load_profiles()["vllm"].parameters.request_overhead_ms
    _code, out, _ = run(capsys, "--gpu", "h200", "--gpus", "8")
    line = next(line for line in out.splitlines() if line.startswith("performance model:"))
    assert "small kernels per layer" in line
    assert f"{request_ms:.1f} ms per request before its first token" in line


def test_fp8_on_8_h100_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] is False
    assert plan["predictions"] == []
    code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100")
    assert "does not fit" in out and "--weights awq-int4" in out


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", AWQ, "--gpu", "h100", "--gpu-hour-usd", "2.5", "--slo-itl-ms", "60")
    assert code == 0
    for text in ("memory per GPU", "routed_experts", "fits", "output tok/s", "highest concurrency", "vllm:", "sglang:"):
        assert text in out
    for topic in ("why quantization", "why layout", "why kv cache", "why performance", "performance model"):
        assert topic in out


def test_explanations_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--model", AWQ, "--gpu", "h100", "--json")
    plan = json.loads(out)
    why = {e["topic"]: e["text"] for e in plan["explanations"]}
    assert set(why) == {"quantization", "layout", "kv_cache", "performance"}
    assert "checkpoint's own format" in why["quantization"]
    assert "TP=8" in why["layout"] and "inside a node" in why["layout"]
    # the KV cache is the budget minus weights minus reserve, per GPU, with the replicated latent's bytes per token
    budget, weights, reserve = (
        plan[k] / 1e9 for k in ("budget_bytes_per_gpu", "weights_bytes_per_gpu", "reserve_bytes_per_gpu")
    )
    assert f"= {budget:,.1f} GB, minus weights {weights:,.1f} GB, minus reserve {reserve:,.1f} GB" in why["kv_cache"]
    assert "70,272 B on every GPU" in why["kv_cache"] and "TP does not divide the cache" in why["kv_cache"]
    assert plan["performance_model"]["engine_profile"] == "vllm"
    assert set(plan["performance_model"]["kinds"]) == {"dense_gemm", "moe_gemm", "mla_decode", "mla_prefill"}
    _code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100", "--json")
    why = {e["topic"]: e["text"] for e in json.loads(out)["explanations"]}
    assert "exceed the" in why["quantization"] and "awq-int4" in why["quantization"]  # what would fit instead
    assert "16 x h100-sxm" in why["layout"]
    _code, out, _ = run(capsys, "--gpu", "a100", "--weights", "fp8", "--gpus", "16", "--nodes", "2", "--json")
    why = {e["topic"]: e["text"] for e in json.loads(out)["explanations"]}
    assert "no FP8 units" in why["quantization"]
    assert "PP=2" in why["layout"]


def test_plan_on_this_machine_uses_its_measurement(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepserve.hardware import host

    measured = host.HostMeasurement("box", "Test CPU", 2, 10.0, 50.0, 15.0, "2026-11-22T00:00:00Z", native_bf16=False)
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    code, out, _ = run(
        capsys,
        "--model",
        "deepserve/tiny-deepseek-v3",
        "--gpu",
        "host",
        "--gpus",
        "1",
        "--concurrency",
        "1,64",
        "--json",
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["gpu"] == "host" and plan["performance_model"]["engine_profile"] == "vllm-cpu"
    low, high = plan["predictions"]
    assert high["output_throughput_tok_s"] > low["output_throughput_tok_s"] and high["tpot_ms"] > low["tpot_ms"]
    from deepserve.hardware.catalog import host_accelerator

    # vLLM's CPU build runs a bf16 model through PyTorch's bf16 linear: its measured rate, not NumPy's fp32 BLAS
    assert host_accelerator(measured).peak_tflops("bf16") == pytest.approx(0.015)
    without_torch = host.HostMeasurement("box", "Test CPU", 2, 10.0, 50.0, None, "2026-11-22T00:00:00Z")
    assert host_accelerator(without_torch).peak_tflops("bf16") == pytest.approx(0.050)


def test_cost_per_million_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--model", AWQ, "--gpu", "h100", "--gpu-hour-usd", "2", "--concurrency", "8", "--json")
    p = json.loads(out)["predictions"][0]
    expected = 2 * 8 / 3600 / p["output_throughput_tok_s"] * 1e6
    assert p["usd_per_million_output_tokens"] == pytest.approx(expected, rel=1e-3)


def test_dp_attention_commands(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--gpu", "h200", "--tp", "1", "--dp", "8", "--ep", "--json")
    plan = json.loads(out)
    assert plan["layout"] == {"tp": 1, "pp": 1, "dp": 8, "ep": True}
    assert "--data-parallel-size 8" in plan["commands"]["vllm"]
    assert "--enable-expert-parallel" in plan["commands"]["vllm"]
    sglang = plan["commands"]["sglang"]
    assert "--tp-size 8" in sglang and "--dp-size 8" in sglang and "--enable-dp-attention" in sglang


def test_on_the_fly_fp8_sets_quantization(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM quantizes a 16-bit checkpoint to FP8 while loading; an FP8-block checkpoint (V3) it loads as stored."""
    _code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V2-Lite", "--gpu", "b200", "--weights", "fp8-dynamic",
                        "--json")  # fmt: skip
    assert "--quantization fp8" in json.loads(out)["commands"]["vllm"]
    _code, out, _ = run(capsys, "--gpu", "b200", "--weights", "fp8-dynamic", "--json")
    assert json.loads(out)["commands"]["vllm"].startswith("n/a: no checkpoint of deepseek-ai/DeepSeek-V3 stored as")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--gpu", "h1000"), "unknown GPU 'h1000'; valid: a100-40gb"),
        (("--gpu", "h100", "--gpus", "6", "--tp", "6"), "does not divide"),
        (("--gpu", "h100", "--gpus", "8", "--tp", "8", "--pp", "2"), "16 GPUs but --gpus is 8"),
        (("--gpu", "h100", "--weights", "int3"), "unknown weight format"),
        (("--gpu", "h100", "--network", "pigeon"), "unknown network"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    code, _out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_model_config_missing_fields(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    code, _, err = run(capsys, "--model", str(tmp_path))
    assert code == 2
    assert "lacks required field(s) num_hidden_layers" in err


def test_bad_concurrency_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["plan", "--concurrency", "1,a"])
    assert exit_info.value.code == 2
    assert "comma-separated" in capsys.readouterr().err


def test_config_file_section(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "deepserve.yaml"
    config.write_text("plan:\n  gpu: h200\n  input_len: 2048\n  concurrency: [2, 3]\n")
    _code, out, _ = run(capsys, "--config", str(config), "--json")
    plan = json.loads(out)
    assert plan["gpu"] == "h200" and plan["input_len"] == 2048
    assert [p["concurrency"] for p in plan["predictions"]] == [2, 3]


def test_validate_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "--steady")
    assert code == 0
    assert out.index("leave-one-source-out over") < out.index("in-sample (fitted on every row) over")
    assert "MAPE by source" in out and "MAPE by layout kind" in out and "cannot predict" in out and "trtllm" in out
    code, out, _ = run(capsys, "validate", "--steady", "--json")
    data = json.loads(out)
    held = data["leave_one_source_out"]
    assert held["headline_mape_pct_by_metric"]["tpot"] <= 30
    assert {"by_source", "by_layout_kind", "by_run"} <= held.keys()
    counted = len(data["in_sample"]["rows"]) + len(data["unpredictable"]) + len(data["not_held_out"])
    assert counted == 31 + 382
    code, out, _ = run(capsys, "validate", "--steady", "--markdown")
    assert "| source |" in out and "| layout kind |" in out
    code, _out, _ = run(capsys, "validate", "--steady", "--cross-validate")  # the earlier flag still parses
    assert code == 0


def test_calibration_file_is_used(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    figures = {"memory_efficiency": 0.5, "compute_efficiency": 0.4, "floor_us": 10}
    calibration.write_text(
        json.dumps(
            {
                "format": CALIBRATION_FORMAT,
                "device": "NVIDIA H100 80GB HBM3",
                "hardware_class": "hopper",
                "planner": {"kinds": {"moe_gemm": {"int4": figures}}},
            }
        )
    )
    _code, base, _ = run(capsys, "--model", AWQ, "--gpu", "h100", "--concurrency", "64", "--json")
    _code, out, _ = run(
        capsys, "--model", AWQ, "--gpu", "h100", "--concurrency", "64", "--calibration", str(calibration), "--json"
    )
    kinds = json.loads(out)["performance_model"]["kinds"]
    assert kinds["moe_gemm"]["memory_efficiency"] == 0.5 and kinds["moe_gemm"]["source"].startswith("measured on")
    slower = json.loads(out)["predictions"][0]["output_throughput_tok_s"]
    assert slower < json.loads(base)["predictions"][0]["output_throughput_tok_s"]


def test_two_nodes_commands(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--gpu", "h100", "--gpus", "16", "--nodes", "2", "--weights", "fp8", "--json")
    plan = json.loads(out)
    assert plan["layout"] == {"tp": 8, "pp": 2, "dp": 1, "ep": False}
    assert "--pipeline-parallel-size 2" in plan["commands"]["vllm"]
    assert "--nnodes 2" in plan["commands"]["sglang"] and "--pp-size 2" in plan["commands"]["sglang"]
    assert "--nnodes 2 --node-rank 1 --master-addr HEAD_NODE_IP" in plan["serve_commands"][1]
    _code, out, _ = run(capsys, "--gpu", "h100", "--gpus", "16", "--weights", "fp8")  # two nodes of 8 by default
    assert "deepserve on 2 nodes" in out and "node 1: deepserve serve" in out
    assert "$/1M out tok" not in out and "give --gpu-hour-usd" in out
    _code, out, _ = run(capsys, "--gpu", "h100", "--gpus", "16", "--weights", "fp8", "--gpu-hour-usd", "2")
    assert "$/1M out tok" in out


def test_unknown_engine_is_rejected_with_the_registered_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(["plan", "--engine", "tensorrt"]) == 2
    assert "unknown engine 'tensorrt'; valid: sglang, trtllm, vllm" in capsys.readouterr().err


def test_trtllm_plan_uses_its_own_profile_and_prints_its_options_file(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--gpu", "h200", "--engine", "trtllm", "--tp", "1", "--dp", "8", "--ep", "--json")
    plan = json.loads(out)
    assert plan["efficiency_factors"]["profile"] == "trtllm"
    assert "transferred" not in plan["efficiency_factors"]["provenance"]
    command = plan["commands"]["trtllm"]
    assert "enable_attention_dp: true" in command and "--tp_size 8 --ep_size 8" in command
    assert command.splitlines()[-1].startswith("trtllm-serve deepseek-ai/DeepSeek-V3 --backend pytorch")


def test_amd_plan_commands_carry_rocm_settings_and_refuse_trtllm(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--gpu", "mi300x", "--weights", "fp8", "--json")
    commands = json.loads(out)["commands"]
    assert commands["vllm"].startswith("VLLM_ROCM_USE_AITER=1 vllm serve")
    assert commands["sglang"].startswith("SGLANG_USE_AITER=1 ") and "--attention-backend aiter" in commands["sglang"]
    assert commands["trtllm"].startswith("n/a: TensorRT-LLM has no ROCm build")


def test_a_plan_that_does_not_fit_names_the_gpus_that_would(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100", "--json")
    plan = json.loads(out)
    assert plan["smallest_fitting_gpus"] == 16  # FP8 needs two nodes of H100
    assert plan["mtp_params_not_loaded"] > 10e9
    _code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h200", "--json")
    assert json.loads(out)["fits"] is True and json.loads(out)["smallest_fitting_gpus"] is None
    _code, out, _ = run(capsys, "--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100")
    assert "it fits on 16 x h100-sxm (2 node(s)" in out
    assert "MTP module" in out


def test_wide_ep_over_two_nodes_needs_no_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp 1 --dp 16 --ep on 16 GPUs is wide EP over two nodes with PP 1 (issue 20: PP = nodes was added and the
    layout refused); --max-num-seqs is each data-parallel rank's."""
    code, out, err = run(capsys, "--gpu", "h100", "--gpus", "16", "--tp", "1", "--dp", "16", "--ep", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["layout"] == {"tp": 1, "pp": 1, "dp": 16, "ep": True} and plan["nodes"] == 2
    per_rank = plan["max_num_seqs_per_dp_rank"]
    assert f"--max-num-seqs {per_rank}" in plan["commands"]["vllm"]
    # each rank's share of what the KV cache holds, rounded down so that all ranks together stay within it
    assert per_rank * 16 <= plan["max_concurrent_sequences"] < (per_rank + 1) * 16
    assert "each of the 16 data-parallel ranks" in " ".join(e["text"] for e in plan["explanations"])


def test_a_format_the_checkpoint_lacks_loads_its_published_export(capsys: pytest.CaptureFixture[str]) -> None:
    """Planned as AWQ, the commands must load the AWQ export: DeepSeek-V3's own FP8 checkpoint would not fit the
    memory the plan gave the KV cache."""
    _code, out, _ = run(capsys, "--gpu", "h100", "--weights", "awq-int4", "--json")
    plan = json.loads(out)
    assert plan["weights"] == "awq-int4" and plan["fits"]
    for line in [*plan["commands"].values(), *plan["serve_commands"]]:
        assert AWQ in line and "deepseek-ai/DeepSeek-V3 " not in line
    render = plan["deploy_render_command"]
    assert f"--model {AWQ}" in render and "--weights" not in render  # the export's own format: nothing to say
    why = {e["topic"]: e["text"] for e in plan["explanations"]}["quantization"]
    assert f"the commands load {AWQ}, the published export of deepseek-ai/DeepSeek-V3's weights in awq-int4" in why


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("--model", "v3.2", "--weights", "awq-int4"), "no checkpoint of deepseek-ai/DeepSeek-V3.2 stored as awq-int4"),
        (
            ("--weights", "awq-int4", "--speculative-method", "mtp"),
            f"{AWQ}, the export of deepseek-ai/DeepSeek-V3's weights in awq-int4, has no draft module for mtp",
        ),
    ],
)
def test_without_a_checkpoint_in_the_planned_format_no_command_is_offered(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], reason: str
) -> None:
    _code, out, _ = run(capsys, "--gpu", "h200", *argv, "--json")
    plan = json.loads(out)
    lines = [*plan["commands"].values(), *plan["serve_commands"], plan["deploy_render_command"]]
    assert all(line.startswith("n/a: ") and reason in line for line in lines)
    _code, out, _ = run(capsys, "--gpu", "h200", *argv)
    assert f"deepserve: n/a: {reason}" in " ".join(out.split())


@pytest.mark.parametrize(
    ("model", "weights"),
    [("deepseek-ai/DeepSeek-V3", "fp8"), ("deepseek-ai/DeepSeek-V2-Lite", "fp8-dynamic"), (AWQ, None)],
)
def test_a_checkpoint_that_loads_as_planned_is_served_as_named(
    capsys: pytest.CaptureFixture[str], model: str, weights: str | None
) -> None:
    argv = ("--weights", weights) if weights else ()
    _code, out, _ = run(capsys, "--model", model, "--gpu", "h200", *argv, "--json")
    plan = json.loads(out)
    assert plan["serve_commands"][0].startswith(f"deepserve serve --model {model} ")
    assert f"--model {model} " in plan["deploy_render_command"]


def test_an_nvl72_plan_prints_a_serve_line_per_compute_tray(capsys: pytest.CaptureFixture[str]) -> None:
    _code, out, _ = run(capsys, "--gpu", "gb200", "--gpus", "72", "--tp", "1", "--dp", "72", "--ep", "--json")
    plan = json.loads(out)
    assert plan["nodes"] == 1  # one NVLink domain for the performance model
    lines = plan["serve_commands"]
    assert len(lines) == 18 and all("--nnodes 18" in line for line in lines)
    assert "--node-rank 17" in lines[-1]


def test_the_serve_lines_run_the_plans_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """The figures are the plan engine's, so its `deepserve serve` lines launch that engine, or say why they cannot."""
    _code, out, _ = run(capsys, "--gpu", "h200", "--engine", "sglang", "--json")
    plan = json.loads(out)
    assert plan["serve_commands"][0].startswith("deepserve serve --engine sglang ")
    assert "--engine sglang" in plan["deploy_render_command"]
    _code, out, _ = run(capsys, "--gpu", "h100", "--gpus", "16", "--engine", "trtllm", "--json")
    plan = json.loads(out)
    assert plan["serve_commands"] == [plan["commands"]["trtllm"]]
    assert plan["serve_commands"][0].startswith("n/a: --nnodes 2: TensorRT-LLM spans nodes under MPI")


def test_engine_lines_load_the_hub_id_an_alias_stands_for(capsys: pytest.CaptureFixture[str]) -> None:
    """The engines know nothing of deepserve's aliases: `vllm serve v4-flash` would look for a repository of that
    name. deepserve's own lines may keep the alias (serve resolves it)."""
    _code, out, _ = run(capsys, "--model", "v4-flash", "--gpu", "h200", "--json")
    plan = json.loads(out)
    assert plan["commands"]["vllm"].startswith("vllm serve deepseek-ai/DeepSeek-V4-Flash --served-model-name ")
    assert "--model-path deepseek-ai/DeepSeek-V4-Flash " in plan["commands"]["sglang"]
    assert "trtllm-serve deepseek-ai/DeepSeek-V4-Flash " in plan["commands"]["trtllm"]


@pytest.mark.parametrize(("model", "limit"), [("v3", "163,840"), ("v4-flash", "1,048,576")])
def test_a_context_beyond_the_models_positions_is_refused(
    capsys: pytest.CaptureFixture[str], model: str, limit: str
) -> None:
    """vLLM refuses max_model_len past max_position_embeddings (YaRN checkpoints state it scaled), so a plan for it
    would print commands that never start."""
    code, _out, err = run(capsys, "--model", model, "--gpu", "b200", "--max-model-len", "2000000")
    assert code != 0
    assert "--max-model-len 2,000,000 exceeds" in err and f"{limit} positions (max_position_embeddings)" in err


def test_trays_of_an_nvl72_rack_are_named_as_one_nvlink_domain(capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes counts machines: 12 GB200 trays are one NVLink domain, and the plan says both."""
    code, out, _ = run(capsys, "--gpu", "gb200", "--gpus", "48", "--nodes", "12", "--tp", "1", "--dp", "48", "--ep")
    assert code == 0 and "48 x gb200 (1 NVLink domain(s) over 12 machines)" in " ".join(out.split())
