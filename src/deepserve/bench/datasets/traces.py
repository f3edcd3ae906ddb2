"""Trace replay: Mooncake-format JSONL traces, and vLLM's `timed_trace` (the same format, vLLM's defaults).

The format is the one Mooncake (Kimi's serving platform) published with its FAST'25 paper, in
github.com/kvcache-ai/Mooncake, FAST25-release/traces: one JSON object per line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, …, 2354]}

`timestamp` is the arrival in milliseconds, `input_length` and `output_length` are token counts, and `hash_ids`
name the prompt's blocks of 512 tokens (the last one may be partial): two requests whose lists start with the same
ids had the same leading blocks. The texts were withheld; the ids keep what matters to a prefix cache.

A prompt here is rebuilt from its ids: every (id, position) gets one block of random text, built once; a prompt is
its blocks' texts in order, cut to exactly `input_length` server tokens (the template's tokens included, as for
every dataset here; the first block holds the tokens the server puts before the text). So prompts that share
leading ids share exactly those leading token blocks, and a prefix cache sees what it saw in the trace. Each
prompt is measured once and its shared blocks are checked token by token: a tokenizer that merged text across a
block boundary would be an error, never a silently different prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepserve.bench.datasets.base import DatasetContext, DatasetError, DatasetResult, DraftRequest
from deepserve.bench.datasets.files import ALL_REQUESTS, read_text, require_path
from deepserve.bench.datasets.text import render_prompt

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_SECONDS_PER_UNIT = 0.001  # Mooncake's timestamps are milliseconds
MOONCAKE_EXAMPLE = '{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}'


@dataclass(frozen=True)
class TraceEntry:
    line: int
    timestamp: float  # in the trace's unit
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceLabels:
    """The JSON keys of each field (vLLM's --timed-trace-label-* flags)."""

    timestamp: str = "timestamp"
    input_length: str = "input_length"
    output_length: str = "output_length"
    hash_ids: str = "hash_ids"


def parse_trace_line(raw: str, path: Path, line: int, labels: TraceLabels) -> TraceEntry:
    where = f"{path}:{line}"
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); expected {MOONCAKE_EXAMPLE}"
        ) from exc
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object such as {MOONCAKE_EXAMPLE}, got {type(item).__name__}")
    timestamp = _field(item, labels.timestamp, where, (int, float))
    if timestamp < 0:
        raise DatasetError(f"{where}: '{labels.timestamp}' must not be negative, got {timestamp}")
    input_length = _positive_int(item, labels.input_length, where)
    output_length = _positive_int(item, labels.output_length, where)
    hash_ids = item.get(labels.hash_ids, [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise DatasetError(f"{where}: '{labels.hash_ids}' must be a list of integers, got {hash_ids!r}")
    return TraceEntry(line, float(timestamp), input_length, output_length, tuple(hash_ids))


def _field(item: dict[str, Any], key: str, where: str, kinds: tuple[type, ...]) -> Any:
    if key not in item:
        raise DatasetError(f"{where}: no '{key}' key (keys: {', '.join(item) or 'none'}); expected {MOONCAKE_EXAMPLE}")
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise DatasetError(f"{where}: '{key}' must be a number, got {value!r}")
    return value


def _positive_int(item: dict[str, Any], key: str, where: str) -> int:
    value = _field(item, key, where, (int,))
    if value < 1:
        raise DatasetError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return int(value)


def load_trace(path: Path, labels: TraceLabels, limit: int = 0) -> list[TraceEntry]:
    """The trace's first LIMIT requests (0: all), in file order."""
    entries: list[TraceEntry] = []
    for number, raw in enumerate(read_text(path).splitlines(), start=1):
        if raw.strip():
            entries.append(parse_trace_line(raw, path, number, labels))
            if limit and len(entries) >= limit:
                break
    if not entries:
        raise DatasetError(f"{path}: no requests; expected one JSON object per line, e.g. {MOONCAKE_EXAMPLE}")
    return entries


@dataclass(frozen=True)
class _Block:
    text: str
    ids: list[int]  # its server tokens as part of a prompt


class BlockPrompts:
    """Prompts made of shared token blocks. Block texts are built once per (hash id, first or not): the first
    block of a prompt holds the template's leading tokens, so it has fewer tokens of text."""

    def __init__(self, ctx: DatasetContext, block_tokens: int, path: Path) -> None:
        self.ctx = ctx
        self.path = path
        self.block_tokens = block_tokens
        self.header, self.trailer = ctx.builder.template_split()
        if block_tokens <= self.header:
            raise DatasetError(
                f"a trace block of {block_tokens} tokens cannot hold the {self.header} tokens the server puts "
                "before every prompt; use a larger --trace-block-size"
            )
        self._blocks: dict[tuple[bool, int], _Block] = {}

    @property
    def built(self) -> int:
        """Distinct blocks built."""
        return len(self._blocks)

    def text_tokens(self, first: bool) -> int:
        return self.block_tokens - self.header if first else self.block_tokens

    def prepare(self, entries: list[TraceEntry]) -> None:
        """Build every block the entries use (overlapped with a server tokenizer)."""
        keys = sorted({key for entry in entries for key in self._keys(entry)})
        blocks = self.ctx.map_tokenizing(lambda i: self._build_block(*keys[i]), len(keys))
        self._blocks.update(zip(keys, blocks, strict=True))

    def _keys(self, entry: TraceEntry) -> list[tuple[bool, int]]:
        text_len, keys = self._text_len(entry), []
        covered = 0
        for position, hash_id in enumerate(entry.hash_ids):
            if covered >= text_len:
                break
            keys.append((position == 0, hash_id))
            covered += self.text_tokens(position == 0)
        return keys

    def _text_len(self, entry: TraceEntry) -> int:
        return entry.input_length - self.header - self.trailer

    def _build_block(self, first: bool, hash_id: int) -> _Block:
        target = self.text_tokens(first) + self.header + self.trailer
        text = self.ctx.builder.build(target, self.ctx.rng(f"trace-block/{int(first)}/{hash_id}"))
        ids = self.ctx.counter.prompt_ids(render_prompt(text, self.ctx.chat))
        return _Block(text, ids[self.header : len(ids) - self.trailer])

    def prompt(self, entry: TraceEntry, index: int) -> str:
        """The text of ENTRY's prompt: its blocks in order, cut to exactly input_length server tokens."""
        text_len = self._text_len(entry)
        if text_len < 0:
            raise DatasetError(
                f"{self.path}:{entry.line}: an input_length of {entry.input_length} tokens is shorter than the "
                f"{self.header + self.trailer} tokens of the template around every prompt"
            )
        whole: list[str] = []
        expected: list[int] = []  # the text tokens the shared blocks must give
        partial = ""
        for key in self._keys(entry):
            block = self._blocks[key]
            room = text_len - len(expected)
            if len(block.ids) > room:  # the last block is partial: its first tokens, decoded on a token boundary
                partial = self.ctx.counter.decode(block.ids[:room]) if self.ctx.builder.can_decode else ""
                break
            whole.append(block.text)
            expected += block.ids
        head = "".join(whole)
        text = head + partial
        ids = self.ctx.counter.prompt_ids(render_prompt(text, self.ctx.chat))
        if len(ids) != entry.input_length:  # a partial block or no ids left: an exact tail after the whole blocks
            text = self.ctx.builder.build(entry.input_length, self.ctx.rng(f"trace-tail/{index}"), head)
            ids = self.ctx.counter.prompt_ids(render_prompt(text, self.ctx.chat))
        shared = ids[self.header : self.header + len(expected)]
        if shared != expected:
            raise DatasetError(
                f"{self.path}:{entry.line}: with {self.ctx.counter.source}, the text of this prompt's blocks does "
                "not keep its tokens when joined (the tokenizer merges across block boundaries), so prompts that "
                "share hash ids would not share tokens; try another --trace-block-size or the server's tokenizer"
            )
        return text


def replay_times_s(entries: list[TraceEntry], seconds_per_unit: float, time_scale: float) -> list[float]:
    """Release times in seconds after the first request: (timestamp − first timestamp) × unit × scale."""
    first = min(entry.timestamp for entry in entries)
    return [(entry.timestamp - first) * seconds_per_unit * time_scale for entry in entries]


class MooncakeDataset:
    """A Mooncake-format trace: requests at the trace's times, exact input lengths, shared leading blocks."""

    name = "mooncake"
    default_num_prompts = ALL_REQUESTS
    replays_trace = True
    default_block_tokens = MOONCAKE_BLOCK_TOKENS
    default_seconds_per_unit = MOONCAKE_SECONDS_PER_UNIT

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult:
        path = require_path(config, self.name)
        entries = load_trace(path, trace_labels(config), num_prompts)
        entries.sort(key=lambda entry: entry.timestamp)  # stable: lines of one instant keep their order
        block_tokens = config.trace_block_size or self.default_block_tokens
        unit_s = config.timed_trace_sec_multiplier or self.default_seconds_per_unit
        blocks = BlockPrompts(ctx, block_tokens, path)
        blocks.prepare(entries)
        texts = ctx.map_tokenizing(lambda i: blocks.prompt(entries[i], i), len(entries))
        times = replay_times_s(entries, unit_s, config.trace_time_scale)
        requests = [
            DraftRequest(render_prompt(text, ctx.chat), entry.input_length, entry.output_length, at)
            for text, entry, at in zip(texts, entries, times, strict=True)
        ]
        details = {
            "dataset_path": str(path),
            "trace_requests": len(entries),
            "trace_block_size": block_tokens,
            "trace_seconds_per_unit": unit_s,
            "trace_time_scale": config.trace_time_scale,
            "trace_span_s": times[-1] if times else 0.0,
            "trace_blocks": blocks.built,
        }
        return DatasetResult(requests, details)


class TimedTraceDataset(MooncakeDataset):
    """vLLM's `timed_trace`: the same JSONL, with vLLM's defaults (blocks of 16 tokens, timestamps in seconds;
    --timed-trace-chunk-hash-size and --timed-trace-sec-multiplier change them, as in vLLM)."""

    name = "timed_trace"
    default_block_tokens = 16
    default_seconds_per_unit = 1.0


def trace_labels(config: WorkloadConfig) -> TraceLabels:
    return TraceLabels(
        config.timed_trace_label_timestamp,
        config.timed_trace_label_input_length,
        config.timed_trace_label_output_length,
        config.timed_trace_label_hash_ids,
    )
