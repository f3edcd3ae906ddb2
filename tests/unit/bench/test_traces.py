"""Trace replay (Mooncake's JSONL format): prompts of exactly each line's input length, leading token blocks shared
exactly as the lines' leading hash ids are, release times from the timestamps, vLLM's timed_trace defaults, and
clear errors for lines that cannot be used. The fixture trace (tests/fixtures/traces/mooncake_small.jsonl) was
written for these tests: short prompts, so that blocks of 16 tokens give several per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.bench.datasets.base import DatasetError
from deepserve.bench.datasets.text import PromptBuilder
from deepserve.bench.tokenizer import LocalTokenCounter
from deepserve.bench.workloads import WorkloadConfig, build_workload

TRACE = Path(__file__).parents[2] / "fixtures" / "traces" / "mooncake_small.jsonl"
BLOCK = 16


def trace_lines(path: Path = TRACE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_shared_tokens(a: dict, b: dict, header: int, trailer: int) -> int:
    """Server tokens two lines must share: the template's header, then the text of their common leading blocks
    (the first block holds the header, so it has BLOCK - header tokens of text), up to the shorter prompt."""
    text = 0
    for position, (x, y) in enumerate(zip(a.get("hash_ids", []), b.get("hash_ids", []), strict=False)):
        if x != y:
            break
        text += BLOCK - header if position == 0 else BLOCK
    shortest_text = min(a["input_length"], b["input_length"]) - header - trailer
    return header + min(text, shortest_text)


@pytest.mark.parametrize(
    ("tokenizer", "chat"), [("tiny", False), ("tiny", True), ("bpe", False)], ids=["completions", "chat", "bpe"]
)  # the bpe fixture's chat template alone is longer than some of these prompts
def test_prompts_have_their_length_and_share_exactly_their_common_blocks(tokenizer: str, chat: bool, request):
    tiny: LocalTokenCounter = request.getfixturevalue(tokenizer)  # "bpe" merges neighbouring text, "tiny" does not
    config = WorkloadConfig(dataset_name="mooncake", dataset_path=str(TRACE), trace_block_size=BLOCK)
    workload = build_workload(config, tiny, chat)
    lines = trace_lines()
    assert [spec.prompt_len for spec in workload.requests] == [line["input_length"] for line in lines]
    assert [spec.output_len for spec in workload.requests] == [line["output_length"] for line in lines]
    ids = [tiny.prompt_ids(spec.prompt) for spec in workload.requests]
    assert [len(x) for x in ids] == [line["input_length"] for line in lines]  # exact, measured as the server does
    header, trailer = PromptBuilder.create(tiny, chat).template_split()
    for i in range(len(lines)):
        for j in range(i + 1, len(lines)):
            shared = expected_shared_tokens(lines[i], lines[j], header, trailer)
            measured = common_prefix(ids[i], ids[j])
            assert shared <= measured < shared + BLOCK, (i, j, shared, measured)
    # e.g. lines 0 and 1 share blocks 0 and 1 (32 tokens); line 0 is a prefix of line 3 (its block 2 is partial)
    assert common_prefix(ids[0], ids[1]) >= 2 * BLOCK
    if not chat:
        assert ids[3][: len(ids[0])] == ids[0]


def test_requests_are_released_at_the_trace_times_scaled(tiny: LocalTokenCounter):
    config = WorkloadConfig(dataset_name="mooncake", dataset_path=str(TRACE), trace_block_size=BLOCK)
    times_ms = [line["timestamp"] for line in trace_lines()]
    workload = build_workload(config, tiny, chat=False)
    assert [spec.arrival_s for spec in workload.requests] == pytest.approx([t / 1000 for t in times_ms])
    assert workload.self_timed and all(spec.ignore_eos for spec in workload.requests)  # replayed as the trace ran
    faster = build_workload(config.model_copy(update={"trace_time_scale": 0.5}), tiny, chat=False)
    assert [spec.arrival_s for spec in faster.requests] == pytest.approx([t / 2000 for t in times_ms])
    assert faster.digest() != workload.digest()  # the times are part of the workload
    first_three = build_workload(config.model_copy(update={"num_prompts": 3}), tiny, chat=False)
    assert [spec.prompt for spec in first_three.requests] == [spec.prompt for spec in workload.requests[:3]]
    assert workload.definition["self_timed"] is True and workload.definition["trace_block_size"] == BLOCK


def test_mooncake_blocks_are_512_tokens_by_default(tiny: LocalTokenCounter, tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"timestamp": 5, "input_length": 1300, "output_length": 2, "hash_ids": [7, 8, 10]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    workload = build_workload(WorkloadConfig(dataset_name="mooncake", dataset_path=str(trace)), tiny, chat=False)
    first, second = (tiny.prompt_ids(spec.prompt) for spec in workload.requests)
    assert (len(first), len(second)) == (1100, 1300)
    assert 1024 <= common_prefix(first, second) < 1024 + 16


def test_vllm_timed_trace_reads_seconds_and_its_own_labels(tiny: LocalTokenCounter, tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    lines = [{"t": 0.5, "in": 20, "out": 3, "h": [1, 2]}, {"t": 2.0, "in": 24, "out": 4, "h": [1, 3]}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    labels = {
        "timed_trace_label_timestamp": "t",
        "timed_trace_label_input_length": "in",
        "timed_trace_label_output_length": "out",
        "timed_trace_label_hash_ids": "h",
    }
    config = WorkloadConfig(dataset_name="timed_trace", dataset_path=str(trace), **labels)
    workload = build_workload(config, tiny, chat=False)
    assert [spec.arrival_s for spec in workload.requests] == pytest.approx([0.0, 1.5])  # from the first request
    assert [spec.prompt_len for spec in workload.requests] == [20, 24]
    first, second = (tiny.prompt_ids(spec.prompt) for spec in workload.requests)
    assert 16 <= common_prefix(first, second) < 32  # vLLM's 16-token blocks
    by_ms = config.model_copy(update={"timed_trace_sec_multiplier": 0.001})
    assert [spec.arrival_s for spec in build_workload(by_ms, tiny, chat=False).requests] == pytest.approx([0, 0.0015])


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", r"t.jsonl:2: not valid JSON .*expected \{\"timestamp\""),
        ('{"input_length": 5, "output_length": 2}', r"t.jsonl:2: no 'timestamp' key"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 2}', r"'input_length' must be a positive integer"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 2}', r"'timestamp' must not be negative"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": ["a"]}', r"list of integers"),
    ],
)
def test_lines_that_cannot_be_replayed_name_the_file_and_line(tiny: LocalTokenCounter, tmp_path, line, words):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n' + line + "\n")
    with pytest.raises(DatasetError, match=words):
        build_workload(WorkloadConfig(dataset_name="mooncake", dataset_path=str(trace)), tiny, chat=False)


def test_a_prompt_shorter_than_the_template_is_an_error(tiny: LocalTokenCounter, tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 2, "output_length": 2, "hash_ids": [1]}\n')
    with pytest.raises(DatasetError, match="shorter than the 3 tokens of the template"):
        build_workload(WorkloadConfig(dataset_name="mooncake", dataset_path=str(trace)), tiny, chat=True)
