"""Workloads: exact prompt lengths (server tokens) for every dataset and both endpoints, vLLM's length semantics,
seeding, output-length policies, and file parsing with clear errors.

Two real tokenizers (conftest.py): the tiny model's byte-level one (no merges), and a small byte-level BPE whose
merges make decoded random tokens re-encode to a different count, as real BPE tokenizers do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from deepserve.bench.datasets.base import DatasetError
from deepserve.bench.datasets.text import PromptBuilder, pseudo_words
from deepserve.bench.tokenizer import LocalTokenCounter
from deepserve.bench.workloads import DATASETS, WorkloadConfig, build_workload, dataset_names
from deepserve.errors import ConfigError


def _assert_exact(counter: LocalTokenCounter, workload) -> None:
    for spec in workload.requests:
        assert len(counter.prompt_ids(spec.prompt)) == spec.prompt_len, spec.index


def test_bpe_fixture_really_merges(bpe: LocalTokenCounter) -> None:
    """The premise of the exactness tests: decoding tokens and re-encoding changes the count."""
    ids = bpe.encode(" tok") + bpe.encode("ens")
    assert len(bpe.encode(bpe.decode(ids))) < len(ids)


SYNTHETIC = [
    {"dataset_name": "random", "num_prompts": 30, "random_input_len": 120, "random_range_ratio": 0.8},
    {"dataset_name": "random", "num_prompts": 10, "random_input_len": 80, "random_prefix_len": 40},
    {"dataset_name": "long", "long_prompt_len": 10_000},
    {"dataset_name": "sampled", "num_prompts": 12, "sampled_min_input_len": 60, "sampled_max_input_len": 3000},
    {
        "dataset_name": "shared_prefix",
        "num_prompts": 9,
        "random_input_len": 320,
        "shared_prefix_len": 200,
        "num_prefix_groups": 3,
    },
    {
        "dataset_name": "prefix_repetition",
        "num_prompts": 12,
        "prefix_repetition_num_prefixes": 3,
        "prefix_repetition_prefix_len": 64,
        "prefix_repetition_suffix_len": 32,
    },
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("tokenizer", ["tiny", "bpe"])
@pytest.mark.parametrize("values", SYNTHETIC, ids=lambda v: v["dataset_name"])
def test_synthetic_prompts_have_exactly_their_length(values, tokenizer: str, chat: bool, request) -> None:
    counter = request.getfixturevalue(tokenizer)
    workload = build_workload(WorkloadConfig(**values), counter, chat)
    _assert_exact(counter, workload)
    if chat:
        assert all(isinstance(spec.prompt, list) for spec in workload.requests)
    else:
        assert all(isinstance(spec.prompt, str) for spec in workload.requests)


def test_random_lengths_are_vllms_draws(tiny: LocalTokenCounter) -> None:
    """vLLM 0.32's get_sampling_params(np.random.default_rng(7), 8, 0.5, 1024, 128, <1 special token>) returned
    these input (after the BOS) and output lengths; our prompt lengths add the BOS back."""
    vllm_inputs = [1479, 1151, 1212, 1430, 1103, 1306, 1365, 741]
    vllm_outputs = [71, 102, 100, 176, 181, 64, 128, 169]
    config = WorkloadConfig(num_prompts=8, seed=7, random_input_len=1024, random_range_ratio=0.5)
    workload = build_workload(config, tiny, chat=False)
    assert [spec.prompt_len for spec in workload.requests] == [n + 1 for n in vllm_inputs]
    assert [spec.output_len for spec in workload.requests] == vllm_outputs
    assert workload.definition["input_len_range"] == [511 + 1, 1535 + 1]  # floor/ceil(1023 * (1 ∓ 0.5)) + BOS


def test_range_ratio_as_a_json_object_sets_input_and_output_apart(tiny: LocalTokenCounter) -> None:
    config = WorkloadConfig(
        num_prompts=8,
        seed=7,
        random_input_len=100,
        random_output_len=40,
        random_range_ratio='{"input": 0.25, "output": 0.75}',
    )
    workload = build_workload(config, tiny, chat=False)
    assert [s.prompt_len - 1 for s in workload.requests] == [122, 105, 108, 119, 103, 113, 116, 85]  # vLLM's draws
    assert [s.output_len for s in workload.requests] == [13, 28, 27, 63, 65, 10, 40, 60]


def test_random_input_length_counts_the_chat_template_in_chat_mode(tiny: LocalTokenCounter) -> None:
    workload = build_workload(WorkloadConfig(num_prompts=3, random_input_len=50), tiny, chat=True)
    for spec in workload.requests:
        assert spec.prompt_len == 50  # usage.prompt_tokens: BOS + <｜User｜> + 47 text tokens + <｜Assistant｜>
        assert isinstance(spec.prompt, list)  # messages in chat mode
        assert len(tiny.encode(spec.prompt[0]["content"])) == 47


@pytest.mark.parametrize("range_ratio", [1.0, -0.1, 2])
def test_range_ratio_outside_zero_one_is_rejected(range_ratio: float) -> None:
    with pytest.raises(ValidationError, match=r"\[0, 1\)"):
        WorkloadConfig(random_range_ratio=range_ratio)


def test_same_seed_same_requests_other_seed_other_requests(bpe: LocalTokenCounter) -> None:
    config = {"dataset_name": "random", "num_prompts": 20, "random_input_len": 64, "random_range_ratio": 0.5}
    first = build_workload(WorkloadConfig(**config), bpe, chat=False)
    again = build_workload(WorkloadConfig(**config), bpe, chat=False)
    other = build_workload(WorkloadConfig(**config, seed=1), bpe, chat=False)
    assert first.requests == again.requests
    assert first.digest() == again.digest() != other.digest()
    assert [s.prompt for s in first.requests] != [s.prompt for s in other.requests]


def test_shared_prefix_groups_share_exactly_their_prefix(bpe: LocalTokenCounter) -> None:
    """A seed shared 2,000 of 3,200 tokens: same shape, smaller."""
    config = WorkloadConfig(
        dataset_name="shared_prefix",
        num_prompts=8,
        random_input_len=320,
        shared_prefix_fraction=0.625,
        num_prefix_groups=2,
    )
    workload = build_workload(config, bpe, chat=False)
    assert workload.definition["shared_prefix_len"] == 200
    ids = [bpe.prompt_ids(spec.prompt) for spec in workload.requests]
    for i, j in [(0, 2), (0, 6), (1, 3), (5, 7)]:  # groups alternate: even requests group 0, odd group 1
        assert ids[i][:200] == ids[j][:200]
        assert ids[i][:201] != ids[j][:201]
    assert ids[0][:200] != ids[1][:200]
    assert workload.definition["measured_shared_tokens"] == 200


def test_random_prefix_is_shared_by_every_request(tiny: LocalTokenCounter) -> None:
    workload = build_workload(WorkloadConfig(num_prompts=5, random_input_len=30, random_prefix_len=20), tiny, False)
    ids = [tiny.prompt_ids(spec.prompt) for spec in workload.requests]
    assert all(len(x) == 50 for x in ids)  # vLLM: prefix + input_len, the input including the BOS
    assert all(x[:21] == ids[0][:21] for x in ids)  # BOS + 20 prefix tokens


def test_prefix_repetition_follows_vllm_counts_and_shuffles(tiny: LocalTokenCounter) -> None:
    values = {
        "dataset_name": "prefix_repetition",
        "num_prompts": 10,
        "prefix_repetition_num_prefixes": 3,
        "prefix_repetition_prefix_len": 32,
        "prefix_repetition_suffix_len": 16,
    }
    shuffled = build_workload(WorkloadConfig(**values), tiny, chat=False).requests
    ordered = build_workload(WorkloadConfig(**values, disable_shuffle=True), tiny, chat=False).requests
    assert len(ordered) == 9  # 10 // 3 prompts per prefix
    assert all(spec.prompt_len == 48 and spec.output_len == 128 for spec in ordered)
    prefixes = [spec.prompt[:31] for spec in ordered]  # 31 text tokens + the BOS = 32 shared tokens
    assert prefixes[0] == prefixes[1] == prefixes[2] != prefixes[3]
    assert sorted(s.prompt for s in shuffled) == sorted(s.prompt for s in ordered)
    assert [s.prompt for s in shuffled] != [s.prompt for s in ordered]
    with pytest.raises(ConfigError, match="at least"):
        build_workload(WorkloadConfig(**{**values, "num_prompts": 2}), tiny, chat=False)


def test_long_prompts_are_distinct(tiny: LocalTokenCounter) -> None:
    workload = build_workload(WorkloadConfig(dataset_name="long", num_prompts=2, long_prompt_len=16_000), tiny, False)
    assert [s.prompt_len for s in workload.requests] == [16_000, 16_000]
    assert workload.requests[0].prompt != workload.requests[1].prompt


def test_default_number_of_prompts_depends_on_the_dataset(tiny: LocalTokenCounter) -> None:
    assert DATASETS["long"].default_num_prompts == 1
    assert DATASETS["sampled"].default_num_prompts == 200
    assert DATASETS["random"].default_num_prompts == 1000  # vLLM's --num-prompts default
    assert DATASETS["custom"].default_num_prompts == DATASETS["sharegpt"].default_num_prompts == 0  # the whole file
    workload = build_workload(WorkloadConfig(dataset_name="sampled", sampled_max_input_len=200), tiny, False)
    lens = [s.prompt_len for s in workload.requests]
    assert len(lens) == 200 and min(lens) >= 100 and max(lens) <= 200 and len(set(lens)) > 50


def test_output_lengths_drawn_between_min_and_max_with_ignore_eos_and_min_tokens(tiny: LocalTokenCounter) -> None:
    config = WorkloadConfig(
        num_prompts=200,
        random_input_len=8,
        min_output_len=10,
        max_output_len=20,
        ignore_eos=True,
        exact_output_len=True,
    )
    requests = build_workload(config, tiny, chat=False).requests
    lens = [s.output_len for s in requests]
    assert set(lens) == set(range(10, 21))  # 200 uniform draws cover all 11 values
    assert all(s.min_output_len == s.output_len and s.ignore_eos for s in requests)
    plain = build_workload(WorkloadConfig(num_prompts=3, random_input_len=8), tiny, chat=False).requests
    assert all(s.min_output_len is None and not s.ignore_eos for s in plain)


def test_output_bounds_must_come_together_and_in_order() -> None:
    with pytest.raises(ValidationError, match="together"):
        WorkloadConfig(min_output_len=10)
    with pytest.raises(ValidationError, match="> --max-output-len"):
        WorkloadConfig(min_output_len=10, max_output_len=5)


def test_unknown_dataset_lists_the_valid_ones() -> None:
    valid = (
        "agent_trace, custom, long, mooncake, multi_turn, prefix_repetition, random, sampled, shared_prefix, sharegpt"
    )
    with pytest.raises(ValidationError, match=f"unknown dataset 'nonesuch'; valid: {valid}, timed_trace"):
        WorkloadConfig(dataset_name="nonesuch")
    # vLLM's datasets that are not built in say why and what to use instead
    with pytest.raises(ValidationError, match="'hf' .*is not supported: .*Hugging Face hub.*--dataset-name custom"):
        WorkloadConfig(dataset_name="hf")
    assert WorkloadConfig(dataset_name="shared-prefix").dataset_name == "shared_prefix"
    assert ", ".join(dataset_names()) == valid + ", timed_trace"


def test_too_short_for_the_template_is_a_config_error(tiny: LocalTokenCounter) -> None:
    with pytest.raises(ConfigError, match="chat template"):
        build_workload(WorkloadConfig(dataset_name="long", long_prompt_len=2), tiny, chat=True)


def test_definition_is_json_and_names_the_tokenizer(tiny: LocalTokenCounter) -> None:
    workload = build_workload(WorkloadConfig(num_prompts=2, random_input_len=16), tiny, chat=True)
    definition = json.loads(json.dumps(workload.definition))
    assert definition["tokenizer_source"] == tiny.source == workload.tokenizer_source
    assert definition["endpoint"] == "chat" and definition["text_source"] == "vocab"
    assert definition["config"]["random_input_len"] == 16
    rebuilt = build_workload(WorkloadConfig(**definition["config"]), tiny, chat=True)
    assert rebuilt.digest() == workload.digest()


def test_pseudo_words_build_exact_prompts_without_a_vocabulary(bpe: LocalTokenCounter) -> None:
    """The server path has no vocabulary list: pseudo-words, trimmed token by token, must still be exact."""
    import numpy as np

    builder = PromptBuilder(bpe, chat=False, pieces=pseudo_words(), text_source="pseudo_words", tokens_per_piece=3)
    rng = np.random.default_rng(0)
    for target in [1, 2, 3, 17, 200, 1001]:
        assert builder.measure(builder.build(target, rng)) == target
    assert len(pseudo_words()) == len(set(pseudo_words())) == 4096


# ---- files -------------------------------------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_custom_jsonl_prompts_messages_and_output_tokens(tmp_path: Path, tiny: LocalTokenCounter) -> None:
    lines = [
        {"prompt": "What is MLA?", "output_tokens": 10},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why MoE?"}]},
        {"prompt": "Explain prefix caching."},
    ]
    path = _write(tmp_path, "reqs.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    config = WorkloadConfig(dataset_name="custom", dataset_path=path, disable_shuffle=True)
    chat = build_workload(config, tiny, chat=True).requests
    assert len(chat) == 3  # without --num-prompts: the whole file, once
    assert chat[0].prompt == [{"role": "user", "content": "What is MLA?"}]
    assert [s.output_len for s in chat] == [10, 256, 256]  # the line's output_tokens, else vLLM's 256
    _assert_exact(tiny, build_workload(config, tiny, chat=True))
    completions = build_workload(config, tiny, chat=False).requests
    assert completions[0].prompt == "What is MLA?"
    assert completions[1].prompt == "Be brief.<｜User｜>Why MoE?<｜Assistant｜>"  # template rendered, BOS left out
    assert completions[1].prompt_len == len(tiny.prompt_ids(completions[1].prompt))
    fixed = WorkloadConfig(dataset_name="custom", dataset_path=path, custom_output_len=7)
    assert {s.output_len for s in build_workload(fixed, tiny, chat=True).requests} == {7}


def test_custom_oversamples_to_num_prompts_unless_told_not_to(tmp_path: Path, tiny: LocalTokenCounter) -> None:
    path = _write(tmp_path, "two.jsonl", '{"prompt": "a b c d"}\n{"prompt": "e f g h"}\n')
    many = build_workload(WorkloadConfig(dataset_name="custom", dataset_path=path, num_prompts=7), tiny, False)
    assert len(many.requests) == 7 and {s.prompt for s in many.requests} == {"a b c d", "e f g h"}
    assert [s.index for s in many.requests] == list(range(7))
    few = WorkloadConfig(dataset_name="custom", dataset_path=path, num_prompts=7, no_oversample=True)
    assert len(build_workload(few, tiny, False).requests) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": "broken"\n', r"bad\.jsonl:2: not valid JSON .*expected"),
        ('{"prompt": "ok"}\n["a list"]\n', r"bad\.jsonl:2: expected a JSON object"),
        ('\n{"text": "no prompt"}\n', r"bad\.jsonl:2: expected a 'prompt' or 'messages' key"),
        ('{"prompt": ""}\n', r"bad\.jsonl:1: 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "output_tokens": "ten"}\n', r"bad\.jsonl:1: 'output_tokens' must be a positive integer"),
        ('{"messages": [{"role": "user"}]}\n', r"bad\.jsonl:1: messages\[0\] must have a string 'content'"),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"messages\[0\] must be an object with a 'role'"),
        (
            '{"messages": [{"role": "tool", "content": "21 C"}]}\n',
            r"messages\[0\]: a tool message needs the 'tool_call_id'",
        ),
        (
            '{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}]}\n',
            r"messages\[0\]: 'tool_calls' must be a list like",
        ),
        ('{"prompt": "x", "tools": [{"name": "f"}]}\n', r"bad\.jsonl:1: 'tools' must be a list like"),
        ('{"prompt": "x", "tool_choice": "sometimes"}\n', r"'tool_choice' must be none, auto, required"),
        ("\n\n", r"bad\.jsonl: no requests"),
    ],
)
def test_custom_file_errors_name_file_line_and_expectation(tmp_path: Path, tiny, text: str, message: str) -> None:
    path = _write(tmp_path, "bad.jsonl", text)
    with pytest.raises(DatasetError, match=message):
        build_workload(WorkloadConfig(dataset_name="custom", dataset_path=path), tiny, chat=True)


def test_file_datasets_need_an_existing_path(tiny: LocalTokenCounter, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="--dataset-path"):
        build_workload(WorkloadConfig(dataset_name="sharegpt"), tiny, chat=False)
    with pytest.raises(DatasetError, match="does not exist"):
        build_workload(WorkloadConfig(dataset_name="custom", dataset_path=str(tmp_path / "x.jsonl")), tiny, False)


def _conversation(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_sharegpt_first_human_turn_and_first_reply_length(tmp_path: Path, tiny: LocalTokenCounter) -> None:
    data = [
        _conversation(("human", "hi"), ("gpt", "a reply long enough")),  # prompt under 4 tokens: vLLM drops it
        _conversation(("human", "Only one turn")),  # skipped, as vLLM does
        {"id": "no conversations"},  # skipped
        _conversation(
            ("system", "You are helpful."),
            ("human", "Tell me about KV caches."),
            ("gpt", "They store keys and values."),
            ("human", "More?"),
            ("gpt", "x" * 500),
        ),
    ]
    path = _write(tmp_path, "sg.json", json.dumps(data, indent=2))
    config = WorkloadConfig(dataset_name="sharegpt", dataset_path=path, disable_shuffle=True)
    workload = build_workload(config, tiny, chat=False)
    (spec,) = workload.requests
    assert spec.prompt == "Tell me about KV caches."
    assert spec.output_len == len("They store keys and values.")  # byte-level: one token per byte, no BOS
    assert spec.prompt_len == 1 + len("Tell me about KV caches.")
    assert workload.definition["skipped_by_length"] == 1
    chat = build_workload(config, tiny, chat=True).requests[0]
    assert (
        chat.prompt == [{"role": "user", "content": "Tell me about KV caches."}]
        and chat.prompt_len == spec.prompt_len + 2
    )
    override = WorkloadConfig(dataset_name="sharegpt", dataset_path=path, sharegpt_output_len=33)
    assert build_workload(override, tiny, chat=False).requests[0].output_len == 33


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[\n  {"conversations": []},\n  {"conversations": [}\n]', r"sg\.json:3: not valid JSON"),
        ('{"conversations": []}', r"sg\.json:1: expected a JSON array"),
        ('[\n  {"conversations": []},\n\n  "text"\n]', r"sg\.json:4: expected an object with 'conversations'"),
        (
            '[\n {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]',
            r"sg\.json:2: conversations\[0\] must be an object with string 'from' and 'value'",
        ),
        (
            '[{"conversations": [{"from": "gpt", "value": "x"}, {"from": "gpt", "value": "y"}]}]',
            r"sg\.json: no entry has a human turn followed by a reply",
        ),
    ],
)
def test_sharegpt_errors_name_file_line_and_expectation(tmp_path: Path, tiny, text: str, message: str) -> None:
    path = _write(tmp_path, "sg.json", text)
    with pytest.raises(DatasetError, match=message):
        build_workload(WorkloadConfig(dataset_name="sharegpt", dataset_path=path), tiny, chat=False)


def test_messages_on_completions_need_a_local_chat_template(tmp_path: Path, tiny: LocalTokenCounter) -> None:
    """The server's /tokenize cannot render a template to text, so a messages line on /v1/completions is refused
    with the two ways out."""
    import httpx

    from deepserve.bench.tokenizer import ServerTokenCounter

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        tokens = tiny.prompt_ids(body["messages"]) if "messages" in body else tiny.prompt_ids(body["prompt"])
        return httpx.Response(200, json={"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    server = ServerTokenCounter("http://127.0.0.1:8000/v1", "m", None, transport=httpx.MockTransport(handle))
    path = _write(tmp_path, "chat.jsonl", '{"messages": [{"role": "user", "content": "hi there"}]}\n')
    config = WorkloadConfig(dataset_name="custom", dataset_path=path)
    with pytest.raises(DatasetError, match=r"chat\.jsonl:1: 'messages' on the completions endpoint.*--tokenizer"):
        build_workload(config, server, chat=False)
    (spec,) = build_workload(config, server, chat=True).requests
    assert spec.prompt_len == len(tiny.prompt_ids([{"role": "user", "content": "hi there"}]))


@pytest.mark.parametrize(("flag", "expected"), [("0.3", (0.3, 0.3)), ('{"input": 0.25, "output": 0.75}', (0.25, 0.75))])
def test_range_ratio_flag_takes_vllms_number_or_json(flag: str, expected: tuple[float, float]) -> None:
    import argparse

    from deepserve.cli.flags import add_section_flags, section_overrides

    parser = argparse.ArgumentParser()
    add_section_flags(parser, WorkloadConfig)
    args = parser.parse_args(["--random-range-ratio", flag, "--dataset-name", "random"])
    config = WorkloadConfig(**section_overrides(args, WorkloadConfig))
    assert config.range_ratios() == expected
    assert not isinstance(config.random_range_ratio, str)
    with pytest.raises(ValidationError, match="expected a number or"):
        WorkloadConfig(random_range_ratio="wide")
