"""vLLM's flags doing what they do in vLLM, against the simulator with fixed timings: what reaches the request body
and headers, the model each request names, the profiler endpoints, waiting for the server, appended results. The
benchmark's token-ids probe (return_token_ids auto) is the first request each run sends; it is left out below."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.driver import Driver
from deepserve.bench.runner import BenchError, run_benchmark, save_result
from deepserve.cli.main import main
from deepserve.models.tiny import write_tiny_model
from deepserve.simulate.fixed import fixed_timing
from deepserve.simulate.thread import SimulatorThread
from tests.helpers import present, simulator_thread

pytestmark = pytest.mark.timeout(120)


def measured(server: SimulatorThread) -> list[tuple[str, dict]]:
    """(request id, body) of every generation request the simulator received, the token-ids probes left out."""
    request_ids = [present(request_id, "the x-request-id header") for request_id in server.app.stats.request_ids]
    pairs = zip(request_ids, server.app.stats.bodies, strict=True)
    return [(request_id, body) for request_id, body in pairs if not request_id.endswith("probe")]


def bench(base_url: str, **sections) -> BenchConfig:
    target = {"base_url": base_url, **sections.pop("target", {})}
    workload = {"random_input_len": 32, "random_output_len": 3, "num_prompts": 4, **sections.pop("workload", {})}
    return BenchConfig.model_validate(
        {"target": target, "workload": workload, "metrics": {"server_metrics": False}, **sections}
    )


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_flags_reach_every_request_body(endpoint):
    sampling = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.1,
    }
    target = {"endpoint": endpoint, "logprobs": 2, **sampling}
    with simulator_thread(record_bodies=True) as server:
        result = run_benchmark(bench(server.root_url, target=target), display=False)
        bodies = [body for _, body in measured(server)]
    assert len([r for r in result.records if r.success]) == 4
    assert len(bodies) == 4
    for body in bodies:
        assert {name: body[name] for name in sampling} == sampling
        assert "use_beam_search" not in body  # refused: streamed beam search has no per-token timing
        if endpoint.endswith("chat/completions"):
            assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
        else:
            assert body["logprobs"] == 2


def test_chat_template_kwargs_render_messages_sent_to_completions(tmp_path):
    """On /v1/completions the 'messages' of a custom file are rendered here, with --chat-template-kwargs (as vLLM's
    client renders custom prompts); the prompt's length is measured on that rendering."""
    write_tiny_model(tmp_path / "tok")
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}[{{ greeting }}] {{ m['content'] }}{% endfor %}"
    config_path.write_text(json.dumps(tokenizer_config))
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "output_tokens": 3}) + "\n")
    target = {"chat_template_kwargs": '{"greeting": "HELLO"}'}
    workload = {"dataset_name": "custom", "dataset_path": str(dataset), "tokenizer": str(tmp_path / "tok")}
    with simulator_thread(tokenize_endpoints=False, record_bodies=True) as server:
        result = run_benchmark(bench(server.root_url, target=target, workload=workload), display=False)
        bodies = [body for _, body in measured(server)]
    assert [body["prompt"] for body in bodies] == ["[HELLO] hi"] * 4
    assert "chat_template_kwargs" not in bodies[0]
    assert all(record.success for record in result.records)


def test_the_simulator_keeps_request_bodies_only_when_asked():
    """Benchmarks of the client drive the simulator at high rates: bodies are kept only for tests that read them."""
    for record_bodies in (False, True):
        with simulator_thread(record_bodies=record_bodies) as server:
            run_benchmark(bench(server.root_url), display=False)
            assert server.app.stats.requests == 1 + 4  # the probe and the run
            assert len(server.app.stats.bodies) == (1 + 4 if record_bodies else 0)


def test_request_ids_are_prefix_plus_index_and_kept_in_the_records():
    with simulator_thread(record_bodies=True) as server:
        result = run_benchmark(bench(server.root_url, target={"request_id_prefix": "exp7-"}), display=False)
        sent = sorted(request_id for request_id, _ in measured(server))
    assert sent == ["exp7-0", "exp7-1", "exp7-2", "exp7-3"]
    assert [record.request_id for record in result.records] == sent
    with simulator_thread(record_bodies=True) as server:  # vLLM's default: bench-<8 hex digits>-<index>
        run_benchmark(bench(server.root_url), display=False)
        default = sorted(request_id for request_id, _ in measured(server))
    prefix = default[0].removesuffix("0")
    assert prefix.startswith("bench-") and len(prefix) == len("bench-12345678-")
    assert default == [f"{prefix}{i}" for i in range(4)]


def test_served_model_name_is_sent_while_model_names_the_tokenizer_model():
    with simulator_thread(model="served-name", record_bodies=True) as server:
        target = {"model": "/nonexistent/DeepSeek-V3", "served_model_name": "served-name"}
        result = run_benchmark(bench(server.root_url, target=target), display=False)
        models = {body["model"] for body in server.app.stats.bodies}
    assert models == {"served-name"}
    assert result.model_id == "/nonexistent/DeepSeek-V3"  # vLLM's model_id
    assert result.to_json()["served_model_name"] == "served-name"


def test_lora_modules_pick_each_request_model_and_must_be_served():
    with simulator_thread(lora_modules=["lora-a", "lora-b"], record_bodies=True) as server:
        target = {"lora_modules": ["lora-a", "lora-b"], "lora_assignment": "round-robin", "request_id_prefix": "r"}
        run_benchmark(bench(server.root_url, target=target), display=False)
        by_id = {request_id: body["model"] for request_id, body in measured(server)}
        assert by_id == {"r0": "lora-a", "r1": "lora-b", "r2": "lora-a", "r3": "lora-b"}
        with pytest.raises(BenchError, match="unknown model 'lora-c'"):
            run_benchmark(bench(server.root_url, target={"lora_modules": ["lora-c"]}), display=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_profile_starts_after_the_warm_ups_and_stops_after_the_run_or_fails_first(workers):
    profiled = {
        "metrics": {"server_metrics": False, "profile": True},
        "load": {"num_warmups": 2, "num_workers": workers},
    }
    with simulator_thread(profiler_endpoints=True) as server:
        result = run_benchmark(bench(server.root_url, **profiled), False)
        assert server.app.stats.profile_calls == ["/start_profile", "/stop_profile"]
        assert server.app.stats.profile_call_requests == [1 + 2, 1 + 6]  # as vLLM: the 2 warm-ups are not profiled
    assert result.to_json()["profile"] == "started after the warm-ups, stopped after the run"
    assert result.warmups_done == 2
    with simulator_thread(profiler_endpoints=False) as server:
        with pytest.raises(BenchError, match="--profile: POST .*/start_profile answered HTTP 404.*profiler"):
            run_benchmark(bench(server.root_url, **profiled), False)
        assert server.app.stats.requests == 1 + 2  # the probe and the warm-ups only: nothing measured was sent


def test_a_run_that_fails_still_stops_the_profiler(monkeypatch):
    async def broken_dispatch(self):
        raise RuntimeError("dispatcher failed")

    monkeypatch.setattr(Driver, "_dispatch", broken_dispatch)  # a fault inside the measured run
    with simulator_thread(profiler_endpoints=True) as server:
        with pytest.raises(RuntimeError, match="dispatcher failed"):
            run_benchmark(bench(server.root_url, metrics={"server_metrics": False, "profile": True}), False)
        assert server.app.stats.profile_calls == ["/start_profile", "/stop_profile"]


def test_ready_check_waits_for_a_server_that_starts_late(unused_tcp_port):
    late = SimulatorThread(*fixed_timing(), port=unused_tcp_port)
    timer = threading.Timer(1.5, late.__enter__)
    timer.start()
    try:
        started_s = time.monotonic()
        config = bench(late.base_url, target={"ready_check_timeout_sec": 20})
        result = run_benchmark(config, display=False)
        assert time.monotonic() - started_s >= 1.4
        assert sum(record.success for record in result.records) == 4
    finally:
        timer.join()
        late.__exit__()
    with pytest.raises(BenchError, match="cannot reach .*waited 1 s"):
        run_benchmark(bench(late.base_url, target={"ready_check_timeout_sec": 1}), display=False)


def test_append_result_adds_one_json_line_per_run(tmp_path):
    path = tmp_path / "series.json"
    with simulator_thread() as server:
        for _ in range(2):
            save_result(run_benchmark(bench(server.root_url), display=False), path, append=True)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["completed"] == 4 for line in lines)


def test_vllm_command_line_with_ramp_up_runs_through_the_cli(tmp_path, capsys):
    """Burstiness inf makes the gaps fixed: each request is scheduled exactly one gap of its ramp rate after the
    previous one, so the release times show the ramp (without it they would all be 0: --request-rate is inf)."""
    with simulator_thread() as server:
        code = main(
            [
                "bench", "--base-url", server.root_url, "--dataset-name", "random", "--input-len", "32",
                "--output-len", "2", "--num-prompts", "12", "--ramp-up-strategy", "linear", "--ramp-up-start-rps",
                "20", "--ramp-up-end-rps", "200", "--burstiness", "inf", "--result-dir", str(tmp_path),
                "--append-result", "--save-records", "jsonl", "--disable-tqdm", "--no-server-metrics",
            ]
        )  # fmt: skip
    assert code == 0, capsys.readouterr().out
    (saved,) = tmp_path.glob("openai-ramp-up-linear-20qps-200qps-fake-model-*.json")  # vLLM's file name
    data = json.loads(saved.read_text())
    assert (data["ramp_up_strategy"], data["ramp_up_start_rps"], data["ramp_up_end_rps"]) == ("linear", 20, 200)
    assert data["completed"] == 12 and data["total_output_tokens"] == 24
    (records_file,) = tmp_path.glob("*.records.jsonl")
    scheduled_s = [json.loads(line)["scheduled_s"] for line in records_file.read_text().splitlines()]
    rates = [20 + (200 - 20) * i / 11 for i in range(12)]  # vLLM's linear ramp over the 12 requests
    gaps_s = np.diff([0.0, *scheduled_s])
    assert gaps_s == pytest.approx([1 / rate for rate in rates])  # each gap is 1 / its request's rate


def test_a_duration_bound_run_never_sends_an_id_twice():
    """Two prompts for a second of closed loop: the workload is sent again and again, each time under new ids."""
    with simulator_thread(record_bodies=True) as server:
        config = bench(
            server.root_url,
            target={"request_id_prefix": "d-"},
            workload={"num_prompts": 2},
            load={"duration_s": 1.0, "max_concurrency": 2},
        )
        result = run_benchmark(config, display=False)
        sent = [request_id for request_id, _ in measured(server)]
    assert len(sent) > 4
    assert len(set(sent)) == len(sent)
    assert sorted(present(record.request_id) for record in result.records) == sorted(sent)
    assert set(sent) == {f"d-{i}" for i in range(len(sent))}
