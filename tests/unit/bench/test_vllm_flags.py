"""`vllm bench serve` command lines parse into our typed config: every vLLM flag is recognised, those with a meaning
for an OpenAI text-generation benchmark take vLLM's meaning, and the rest fail with a one-line reason."""

from __future__ import annotations

import argparse
import json
import math
import shlex

import numpy as np
import pytest

from deepserve.bench.arrivals import RateRamp, arrival_offsets_s
from deepserve.bench.client import _tls_context, build_payload
from deepserve.bench.config import BenchConfig
from deepserve.bench.types import RequestSpec
from deepserve.bench.vllm_compat import REFUSED_VLLM_FLAGS
from deepserve.cli.bench import add_bench_flags, config_from_args
from deepserve.errors import ConfigError


def parse(command_line: str) -> BenchConfig:
    parser = argparse.ArgumentParser()
    add_bench_flags(parser)
    argv = shlex.split(command_line)
    assert argv[:3] == ["vllm", "bench", "serve"]
    return config_from_args(parser.parse_args(argv[3:]))


def vllm_parser() -> argparse.ArgumentParser:
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    return parser


def test_every_vllm_bench_serve_flag_is_recognised_with_the_same_arity():
    ours = argparse.ArgumentParser()
    add_bench_flags(ours)
    theirs = vllm_parser()
    missing, arity = [], []
    for action in theirs._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue
            mine = ours._option_string_actions.get(flag)
            if mine is None:
                missing.append(flag)
            elif (action.nargs == 0) != (mine.nargs == 0) or (action.nargs in ("+", "*")) != (mine.nargs in ("+", "*")):
                arity.append((flag, action.nargs, mine.nargs))
    assert missing == []
    assert arity == []


def test_a_vllm_command_line_with_sampling_and_length_flags():
    config = parse(
        "vllm bench serve --backend vllm --model /models/DeepSeek-V3 --served-model-name deepseek-v3 "
        "--endpoint /v1/completions --dataset-name random --input-len 512 --output-len 64 --num-prompts 20 "
        "--request-rate 4 --burstiness 0.5 --max-concurrency 8 --temperature 0.6 --top-p 0.95 --top-k 20 "
        "--min-p 0.05 --frequency-penalty 0.1 --presence-penalty 0.2 --repetition-penalty 1.05 --logprobs 3 "
        "--request-id-prefix run7- --insecure --ready-check-timeout-sec 30 --append-result --seed 42 "
        "--tokenizer-mode hf --trust-remote-code --no-stream --percentile-metrics ttft,tpot,itl "
        "--metric-percentiles 90,99"
    )
    target, workload = config.target, config.workload
    assert (target.model, target.served_model_name, target.request_model("/models/DeepSeek-V3")) == (
        "/models/DeepSeek-V3",
        "deepseek-v3",
        "deepseek-v3",
    )
    assert (workload.random_input_len, workload.long_prompt_len) == (512, 512)
    assert (workload.random_output_len, workload.custom_output_len, workload.prefix_repetition_output_len) == (64,) * 3
    assert workload.sharegpt_output_len == 64
    assert (workload.tokenizer_mode, workload.trust_remote_code, workload.no_stream) == ("hf", True, True)
    assert target.request_id_prefix == "run7-" and target.insecure and target.ready_check_timeout_sec == 30
    assert config.output.append_result
    assert target.body_extras() == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.05,
        "logprobs": 3,
    }


def test_sampling_flags_reach_the_request_body_and_extra_body_wins_as_in_vllm():
    config = parse(
        "vllm bench serve --endpoint /v1/chat/completions --min-p 0.1 --presence-penalty 0.5 --logprobs 2 "
        "--chat-template-kwargs '{\"thinking\": true}' --extra-body '{\"min_p\": 0.2}'"
    )
    spec = RequestSpec(index=0, prompt="hi", prompt_len=2, output_len=5)
    body = build_payload(spec, "m", chat=True, extra_body=config.target.body_extras())
    assert body["min_p"] == 0.2  # --extra-body over the sampling flags, as vLLM merges them
    assert body["presence_penalty"] == 0.5
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)  # the chat API's form of "N logprobs per token"
    assert body["chat_template_kwargs"] == {"thinking": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_template_kwargs_on_completions_only_where_messages_are_rendered_here():
    kwargs = "--chat-template-kwargs '{\"thinking\": true}'"
    with pytest.raises(ConfigError, match="chat-template-kwargs has no effect.*random dataset.*leave the flag out"):
        parse(f"vllm bench serve {kwargs}")
    for dataset in ("custom", "sharegpt"):  # their 'messages' lines are rendered with the template on completions
        config = parse(f"vllm bench serve {kwargs} --dataset-name {dataset} --dataset-path f.jsonl")
        assert config.target.template_kwargs() == {"thinking": True}
        assert "chat_template_kwargs" not in config.target.body_extras()  # completions bodies have no such field


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "conversation"])
def test_chat_template_kwargs_must_not_set_what_the_render_sets(key):
    with pytest.raises(ConfigError, match=f"must not set {key}.*leave those keys out") as caught:
        parse(f"vllm bench serve --endpoint /v1/chat/completions --chat-template-kwargs '{{\"{key}\": true}}'")
    assert "\n" not in str(caught.value)


def test_lora_modules_choose_each_request_model_like_vllm():
    config = parse("vllm bench serve --model base --lora-modules a b c --lora-assignment round-robin")
    assert config.target.request_models("base", 5, seed=0) == ["a", "b", "c", "a", "b"]
    random_pick = parse("vllm bench serve --lora-modules a b").target.request_models("base", 400, seed=3)
    assert set(random_pick) == {"a", "b"} and 150 < random_pick.count("a") < 250
    assert random_pick == parse("vllm bench serve --lora-modules a b").target.request_models("base", 400, seed=3)
    assert parse("vllm bench serve").target.request_models("base", 2, seed=0) == ["base", "base"]


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--hf-name AI-MO/aimo-validation-aime", "Hugging Face hub.*--dataset-name custom --dataset-path FILE"),
        ("--hf-split train", "Hugging Face hub"),
        ("--random-mm-base-items-per-request 2", "text generation"),
        ("--asr-max-audio-len-sec 30", "text generation"),
        ("--no-reranker", "text generation"),
        ("--plot-timeline", "deepserve report"),
        ("--plot-dataset-stats", "deepserve report"),
        ("--probe-request-rate 0.5", "not implemented"),
        ("--use-beam-search", "beam search.*TTFT and ITL would mean nothing: leave it out"),
    ],
)
def test_refused_flags_fail_with_one_line_that_names_the_flag_and_the_way_out(flag, words):
    with pytest.raises(ConfigError, match=words) as caught:
        parse(f"vllm bench serve --model m {flag}")
    message = str(caught.value)
    assert message.startswith(flag.split()[0] + " ") and "\n" not in message


@pytest.mark.parametrize(
    ("dataset", "flag"),
    [
        ("hf", "--hf-name"),
        ("speed_bench", "--speed-bench-category"),
        ("spec_bench", "--spec-bench-category"),
        ("random-mm", "--random-mm-bucket-config"),
        ("custom_audio", "--asr-max-audio-len-sec"),
    ],
)
def test_a_refused_vllm_dataset_and_its_flags_fail_with_the_same_reason(dataset, flag):
    takes_value, reason = REFUSED_VLLM_FLAGS[flag]
    with pytest.raises(ConfigError) as by_dataset:
        parse(f"vllm bench serve --dataset-name {dataset}")
    with pytest.raises(ConfigError) as by_flag:
        parse(f"vllm bench serve {flag}" + (" 1" if takes_value else ""))
    assert f"dataset {dataset!r} (a `vllm bench serve` dataset) is not supported: {reason}" in str(by_dataset.value)
    assert str(by_flag.value) == f"{flag} (a `vllm bench serve` flag) is not supported: {reason}"


def test_vllm_trace_replay_flags_map_to_ours():
    config = parse(
        "vllm bench serve --dataset-name timed_trace --dataset-path t.jsonl --timed-trace-chunk-hash-size 512 "
        "--timed-trace-sec-multiplier 0.001 --timed-trace-label-timestamp ts --timed-trace-label-hash-ids blocks"
    )
    workload = config.workload
    assert (workload.dataset_name, workload.trace_block_size, workload.timed_trace_sec_multiplier) == (
        "timed_trace",
        512,
        0.001,
    )
    assert (workload.timed_trace_label_timestamp, workload.timed_trace_label_hash_ids) == ("ts", "blocks")
    assert workload.self_timed_replay and workload.sends_ignore_eos  # vLLM's defaults for timed_trace
    by_rate = parse("vllm bench serve --dataset-name timed_trace --no-self-timed --request-rate 4 --no-ignore-eos")
    assert not by_rate.workload.self_timed_replay and not by_rate.workload.sends_ignore_eos
    assert parse("vllm bench serve --dataset-name mooncake --trace-block-size 64").workload.trace_block_size == 64
    for bad, words in [
        ("--self-timed", "trace replay only"),
        ("--dataset-name mooncake --request-rate 3", "trace's own times.*--no-self-timed"),
        ("--dataset-name timed_trace --timed-trace-chunk-hash-size 16 --trace-block-size 32", "disagree"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse(f"vllm bench serve {bad}")


def test_every_refused_flag_has_a_reason_and_a_remedy():
    for flag, (_, reason) in REFUSED_VLLM_FLAGS.items():
        assert flag.startswith("--") and ("use" in reason or "run" in reason or "leave it out" in reason), flag


def test_vllm_ramp_up_flags_and_their_checks():
    config = parse("vllm bench serve --ramp-up-strategy exponential --ramp-up-start-rps 1 --ramp-up-end-rps 16")
    assert config.load.rate_ramp() == RateRamp("exponential", 1, 16)
    for bad, words in [
        ("--ramp-up-strategy linear --ramp-up-start-rps 1", "needs --ramp-up-start-rps and --ramp-up-end-rps"),
        ("--ramp-up-strategy linear --ramp-up-start-rps 4 --ramp-up-end-rps 2", "not be above"),
        ("--ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 2 --request-rate 3", "leave out"),
        ("--ramp-up-strategy exponential --ramp-up-start-rps 0 --ramp-up-end-rps 2", "above 0"),
        ("--ramp-up-start-rps 1 --ramp-up-end-rps 2", "need --ramp-up-strategy"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse(f"vllm bench serve {bad}")


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_rates_are_vllms(strategy):
    serve = pytest.importorskip("vllm.benchmarks.serve")
    n = 37
    expected = [serve._get_current_request_rate(strategy, 2, 50, i, n, math.inf) for i in range(n)]
    assert RateRamp(strategy, 2, 50).rates(n) == pytest.approx(expected)


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramped_arrivals_follow_the_rate_of_each_stretch_of_requests(strategy):
    ramp = RateRamp(strategy, 2.0, 40.0)
    n, window = 6000, 600
    offsets = np.array(arrival_offsets_s(n, math.inf, 1.0, seed=11, rate_ramp=ramp))
    assert np.all(np.diff(offsets) >= 0)
    rates = ramp.rates(n)
    for start in range(0, n - window, window):
        measured = window / (offsets[start + window] - offsets[start])
        expected = window / np.sum(1.0 / rates[start + 1 : start + window + 1])  # mean gap over the window
        assert measured == pytest.approx(expected, rel=0.15), (start, measured, expected)
    # fixed gaps (burstiness inf): each gap is exactly 1 / its request's rate
    fixed = arrival_offsets_s(5, math.inf, math.inf, seed=0, rate_ramp=RateRamp(strategy, 1.0, 16.0))
    assert np.diff([0.0, *fixed]) == pytest.approx(1.0 / RateRamp(strategy, 1.0, 16.0).rates(5))


def test_insecure_turns_certificate_checks_off():
    assert _tls_context(verify=True).check_hostname is True
    context = _tls_context(verify=False)
    assert (context.check_hostname, context.verify_mode.name) == (False, "CERT_NONE")


def test_chat_template_kwargs_also_shape_how_chat_prompts_are_counted():
    import httpx

    from deepserve.bench.tokenizer import ServerTokenCounter

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"tokens": [1, 2, 3], "count": 3})

    counter = ServerTokenCounter(
        "http://127.0.0.1:9",
        "m",
        None,
        transport=httpx.MockTransport(handler),
        chat_template_kwargs={"thinking": True},
    )
    assert counter.prompt_ids([{"role": "user", "content": "hi"}]) == [1, 2, 3]
    counter.prompt_ids("plain text")
    assert seen[0]["chat_template_kwargs"] == {"thinking": True}
    assert "chat_template_kwargs" not in seen[1]  # a completion prompt has no template


def test_renaming_a_request_replaces_its_one_id_header_or_fails_loudly():
    from deepserve.bench.client import Endpoint, build_request_bytes
    from deepserve.bench.drive_plan import PreparedRequest

    endpoint = Endpoint.from_url("http://127.0.0.1:8000/v1/completions")
    body = {"prompt": "x-request-id: r-0", "max_tokens": 2}

    def prepared(headers: dict[str, str], request_id: str | None) -> PreparedRequest:
        return PreparedRequest(0, 3, build_request_bytes(endpoint, body, headers, request_id), "r-0")

    renamed = prepared({"Authorization": "Bearer k"}, "r-0").renamed("r-7")
    assert renamed.request_id == "r-7"
    assert renamed.wire == build_request_bytes(endpoint, body, {"Authorization": "Bearer k"}, "r-7")
    assert prepared({}, "r-0").renamed("r-9").wire == build_request_bytes(endpoint, body, {}, "r-9")
    with pytest.raises(ValueError, match="exactly once, found none"):
        prepared({}, None).renamed("r-7")  # no id header: it would go out under no id
    with pytest.raises(ValueError, match="exactly once"):
        prepared({"X-Request-Id": "mine"}, "r-0").renamed("r-7")  # --header also sets one: two ids on the wire
