"""Workloads: what `deepserve bench` sends. A WorkloadConfig (field names are `vllm bench serve`'s flag names) and a
token counter make a Workload: seeded RequestSpecs plus a JSON definition, saved with the results, that says how to
make the same requests again.

Every input length is in server tokens: what the server processes and reports as `usage.prompt_tokens`, the BOS
and, on the chat endpoint, the chat template included. docs/WORKLOADS.md describes each dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepserve.bench.datasets.agent_trace import AgentTraceDataset
from deepserve.bench.datasets.base import Dataset, DatasetContext, DraftRequest, draw_uniform_ints
from deepserve.bench.datasets.files import CustomDataset, ShareGPTDataset
from deepserve.bench.datasets.multi_turn import MultiTurnDataset
from deepserve.bench.datasets.synthetic import (
    LongDataset,
    PrefixRepetitionDataset,
    RandomDataset,
    SampledDataset,
    SharedPrefixDataset,
)
from deepserve.bench.datasets.traces import MooncakeDataset, TimedTraceDataset
from deepserve.bench.tokenizer import TokenCounter, counting_method
from deepserve.bench.types import ConversationSpec, RequestSpec
from deepserve.bench.vllm_compat import REFUSED_VLLM_DATASETS, refused_dataset
from deepserve.errors import ConfigError, unknown_name

DATASETS: dict[str, Dataset] = {
    dataset.name: dataset
    for dataset in (
        RandomDataset(),
        LongDataset(),
        SampledDataset(),
        SharedPrefixDataset(),
        PrefixRepetitionDataset(),
        CustomDataset(),
        ShareGPTDataset(),
        MooncakeDataset(),
        TimedTraceDataset(),
        MultiTurnDataset(),
        AgentTraceDataset(),
    )
}
# datasets whose 'messages' lines are rendered with the chat template here on /v1/completions (files.py)
MESSAGES_DATASETS = frozenset({CustomDataset.name, ShareGPTDataset.name})
DATASET_ALIASES = {
    "shared-prefix": "shared_prefix",
    "prefix-repetition": "prefix_repetition",
    "multi-turn": "multi_turn",
    "timed-trace": "timed_trace",
    "agent-trace": "agent_trace",
}
# vLLM's --output-len sets every dataset's own output length (as in vLLM's main_async)
OUTPUT_LEN_FIELDS = ("random_output_len", "sharegpt_output_len", "custom_output_len", "prefix_repetition_output_len")
INPUT_LEN_FIELDS = ("random_input_len", "long_prompt_len")


def dataset_names() -> list[str]:
    return sorted(DATASETS)


def replays_trace(dataset_name: str) -> bool:
    """Whether the dataset's requests carry their own release times (trace replay)."""
    return DATASETS[dataset_name].replays_trace


class WorkloadConfig(BaseModel):
    """What to send. Flags derive from the fields: `--random-input-len` is `random_input_len`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dataset_name: str = Field(
        default="random",
        description="random, long, sampled, shared_prefix, prefix_repetition, multi_turn, custom (JSONL), sharegpt "
        "(JSON), or a trace to replay: mooncake (JSONL), timed_trace (vLLM's), agent_trace (tool-calling sessions)",
    )
    dataset_path: str | None = Field(
        default=None, description="the file for custom, sharegpt, mooncake, timed_trace and agent_trace"
    )
    num_prompts: int | None = Field(
        default=None, ge=1, description="requests to send (default per dataset: 1000; long: 1; sampled: 200)"
    )
    seed: int = Field(default=0, ge=0, description="seed of every random choice: same seed, same requests")
    tokenizer: str | None = Field(
        default=None,
        description="local tokenizer directory (default: the model's directory, else the server's /tokenize)",
    )
    tokenizer_mode: str = Field(
        default="auto", description="vLLM's tokenizer mode: auto or hf load a local tokenizer (others: the server's)"
    )
    trust_remote_code: bool = Field(default=False, description="let a local tokenizer run its own code (vLLM's)")
    skip_tokenizer_init: bool = Field(
        default=False, description="load no local tokenizer: count prompts with the server's /tokenize (vLLM's)"
    )
    exact_prompt_lengths: bool = Field(
        default=False,
        description="refuse to run on approximate prompt lengths (a server without /tokenize and no --tokenizer): "
        "fail instead of counting one token per common English word",
    )
    no_stream: bool = Field(
        default=False,
        description="vLLM's: do not stream the dataset while loading; deepserve always reads dataset files whole",
    )
    input_len: int | None = Field(
        default=None, ge=1, description="vLLM's generic input length: sets --random-input-len and --long-prompt-len"
    )
    output_len: int | None = Field(
        default=None, ge=1, description="vLLM's generic output length: sets every dataset's output length"
    )
    random_input_len: int = Field(default=1024, ge=1, description="input tokens per request (random, shared_prefix)")
    random_output_len: int = Field(default=128, ge=1, description="output tokens per request (synthetic datasets)")
    # str first, so that the derived flag takes text, as vLLM's does: "0.3" or '{"input": 0.3, "output": 0.5}'
    # (the validator below turns it into a number or an object; a str never survives validation)
    random_range_ratio: str | float | dict[str, float] = Field(
        default=0.0,
        description='lengths vary uniformly within ± this fraction, in [0, 1); \'{"input": r, "output": r}\' '
        "sets them apart",
    )
    random_prefix_len: int = Field(default=0, ge=0, description="tokens of a prefix shared by all random requests")
    prefix_repetition_prefix_len: int = Field(default=256, ge=1, description="shared prefix tokens (prefix_repetition)")
    prefix_repetition_suffix_len: int = Field(default=256, ge=1, description="own suffix tokens (prefix_repetition)")
    prefix_repetition_num_prefixes: int = Field(default=10, ge=1, description="distinct prefixes (prefix_repetition)")
    prefix_repetition_output_len: int = Field(default=128, ge=1, description="output tokens (prefix_repetition)")
    custom_output_len: int | None = Field(
        default=None, description="output tokens for custom (default or -1: the line's output_tokens, else 256)"
    )
    sharegpt_output_len: int | None = Field(
        default=None, ge=1, description="output tokens for sharegpt (default: the length of the conversation's reply)"
    )
    disable_shuffle: bool = Field(default=False, description="keep file and prefix_repetition requests in order")
    skip_chat_template: bool = Field(
        default=False,
        description="vLLM's flag, accepted: custom prompts on /v1/completions are sent as written either way",
    )
    no_oversample: bool = Field(
        default=False, description="send fewer requests when a file has fewer than --num-prompts"
    )
    long_prompt_len: int = Field(default=10000, ge=1, description="input tokens of each long prompt (long)")
    sampled_min_input_len: int = Field(default=100, ge=1, description="shortest input (sampled)")
    sampled_max_input_len: int = Field(default=32768, ge=1, description="longest input (sampled)")
    shared_prefix_len: int | None = Field(
        default=None, ge=1, description="tokens shared within a group (shared_prefix)"
    )
    shared_prefix_fraction: float | None = Field(
        default=None, gt=0, lt=1, description="shared tokens as a fraction of --random-input-len (shared_prefix)"
    )
    num_prefix_groups: int = Field(default=1, ge=1, description="groups with distinct prefixes (shared_prefix)")
    min_output_len: int | None = Field(
        default=None,
        ge=1,
        description="with --max-output-len: output tokens uniform in [min, max] per request (any dataset)",
    )
    max_output_len: int | None = Field(default=None, ge=1, description="see --min-output-len")
    ignore_eos: bool | None = Field(
        default=None,
        description="keep generating past EOS (vLLM's ignore_eos); default: on when replaying a trace, else off",
    )
    exact_output_len: bool = Field(
        default=False, description="send min_tokens = max_tokens so each reply has exactly its output length (vLLM)"
    )
    trace_block_size: int | None = Field(
        default=None, ge=1, description="tokens per hash id of a trace (default: mooncake 512, timed_trace 16)"
    )
    trace_time_scale: float = Field(
        default=1.0, gt=0, description="multiply a trace's times: 0.5 replays it twice as fast, 2 half as fast"
    )
    self_timed: bool | None = Field(
        default=None,
        description="release a trace's requests at its own times (default for traces; --no-self-timed sends them "
        "by --request-rate instead, as vLLM's flag)",
    )
    timed_trace_chunk_hash_size: int | None = Field(
        default=None, ge=1, description="vLLM's name for --trace-block-size"
    )
    timed_trace_sec_multiplier: float | None = Field(
        default=None, gt=0, description="seconds per trace time unit (default: mooncake 0.001, timed_trace 1)"
    )
    timed_trace_label_timestamp: str = Field(default="timestamp", description="a trace's key of the arrival time")
    timed_trace_label_input_length: str = Field(default="input_length", description="a trace's key of input tokens")
    timed_trace_label_output_length: str = Field(default="output_length", description="a trace's key of output tokens")
    timed_trace_label_hash_ids: str = Field(default="hash_ids", description="a trace's key of the block hash ids")
    multi_turn_num_turns: int = Field(default=4, ge=1, description="turns per conversation (multi_turn)")
    multi_turn_input_len: int = Field(
        default=128, ge=1, description="text tokens of each later turn's user message (multi_turn)"
    )
    multi_turn_think_time_s: float = Field(
        default=0.0, ge=0, description="seconds a user waits after an answer before the next turn (multi_turn)"
    )
    multi_turn_think_time_ratio: float = Field(
        default=0.0, ge=0, le=1, description="think times uniform within ± this fraction of the mean (multi_turn)"
    )

    @model_validator(mode="before")
    @classmethod
    def _generic_lengths(cls, data: Any) -> Any:
        """--input-len/--output-len override the datasets' own length fields, as in vLLM, and are used up doing so
        (the fields they set are what the workload definition records, and what a sweep point may change)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for generic, fields in (("input_len", INPUT_LEN_FIELDS), ("output_len", OUTPUT_LEN_FIELDS)):
            if data.get(generic) is not None:
                data.update(dict.fromkeys(fields, data.pop(generic)))
        chunk = data.pop("timed_trace_chunk_hash_size", None)
        if chunk is not None:
            if data.get("trace_block_size") not in (None, chunk):
                raise ValueError("--timed-trace-chunk-hash-size and --trace-block-size disagree; give one of them")
            data["trace_block_size"] = chunk
        return data

    @field_validator("random_range_ratio", mode="before")
    @classmethod
    def _parse_ratio(cls, value: Any) -> Any:
        """vLLM's flag takes a float or a JSON object as text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f'expected a number or {{"input": r, "output": r}}, got {value!r}') from exc
        return value

    @field_validator("dataset_name", mode="before")
    @classmethod
    def _known_dataset(cls, value: Any) -> Any:
        name = DATASET_ALIASES.get(value, value) if isinstance(value, str) else value
        if isinstance(name, str) and name in REFUSED_VLLM_DATASETS:
            raise ValueError(refused_dataset(name))
        if isinstance(name, str) and name not in DATASETS:
            raise ValueError(unknown_name("dataset", name, dataset_names()))
        return name

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadConfig:
        self.range_ratios()
        if (self.min_output_len is None) != (self.max_output_len is None):
            raise ValueError("give --min-output-len and --max-output-len together")
        if self.min_output_len and self.max_output_len and self.min_output_len > self.max_output_len:
            raise ValueError(f"--min-output-len {self.min_output_len} > --max-output-len {self.max_output_len}")
        if self.sampled_min_input_len > self.sampled_max_input_len:
            raise ValueError("--sampled-min-input-len is above --sampled-max-input-len")
        if self.shared_prefix_len is not None and self.shared_prefix_fraction is not None:
            raise ValueError("give --shared-prefix-len or --shared-prefix-fraction, not both")
        if self.custom_output_len is not None and self.custom_output_len != -1 and self.custom_output_len < 1:
            raise ValueError("--custom-output-len must be positive, or -1 for the file's output_tokens")
        if self.self_timed is not None and not replays_trace(self.dataset_name):
            raise ValueError(
                "--self-timed/--no-self-timed apply to trace replay only (--dataset-name mooncake or timed_trace)"
            )
        return self

    @property
    def replays_trace(self) -> bool:
        return replays_trace(self.dataset_name)

    @property
    def self_timed_replay(self) -> bool:
        """Requests are released at the trace's own times."""
        return self.replays_trace and self.self_timed is not False

    @property
    def sends_ignore_eos(self) -> bool:
        """--ignore-eos, which defaults to on for trace replay (the trace's output lengths are replayed)."""
        return self.ignore_eos if self.ignore_eos is not None else self.replays_trace

    def range_ratios(self) -> tuple[float, float]:
        """(input, output) range ratios, each in [0, 1) as vLLM requires."""
        ratio = self.random_range_ratio
        if isinstance(ratio, dict):
            if set(ratio) != {"input", "output"}:
                raise ValueError(f'--random-range-ratio as an object needs exactly "input" and "output", got {ratio}')
            pair = (float(ratio["input"]), float(ratio["output"]))
        else:
            pair = (float(ratio), float(ratio))
        if not all(0.0 <= r < 1.0 for r in pair):
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        return pair

    def resolved_shared_prefix_len(self) -> int:
        if self.shared_prefix_len is not None:
            return self.shared_prefix_len
        if self.shared_prefix_fraction is not None:
            return max(1, round(self.shared_prefix_fraction * self.random_input_len))
        raise ConfigError("the shared_prefix dataset needs --shared-prefix-len or --shared-prefix-fraction")


@dataclass
class Workload:
    requests: list[RequestSpec]
    definition: dict[str, Any]  # JSON-able: the config, what it resolved to, and a digest of the requests
    tokenizer_source: str
    conversations: list[ConversationSpec] = field(default_factory=list)  # multi-turn: sent instead of requests
    self_timed: bool = False  # released at the requests' own arrival_s (trace replay)

    def digest(self) -> str:
        return str(self.definition["requests_sha256"])


def build_workload(config: WorkloadConfig, counter: TokenCounter, chat: bool) -> Workload:
    """The requests CONFIG describes, prompts measured with COUNTER for the chat (or completions) endpoint."""
    dataset = DATASETS[config.dataset_name]
    num_prompts = config.num_prompts or dataset.default_num_prompts
    ctx = DatasetContext(counter, chat, config.seed)
    result = dataset.build(config, ctx, num_prompts)
    output_lens = _drawn_output_lens(config, ctx, len(result.requests))
    requests = [
        _spec(i, draft, output_lens[i] if output_lens else None, config) for i, draft in enumerate(result.requests)
    ]
    conversations = result.conversations
    definition: dict[str, Any] = {
        "config": config.model_dump(mode="json"),
        "dataset": dataset.name,
        "num_requests": len(requests) or sum(len(conversation.turns) for conversation in conversations),
        "endpoint": "chat" if chat else "completions",
        "tokenizer_source": counter.source,
        "tokenizer_check": counter.server_check,  # local tokenizers: compared with the server's
        "token_counting": counting_method(counter),  # exact (server, local) or the stated approximation
        "input_len_unit": "server prompt tokens (BOS and chat template included)",
        "text_source": ctx.text_source(),
        **result.details,
        "requests_sha256": requests_digest(requests) if requests else conversations_digest(conversations),
    }
    if config.replays_trace:
        definition["self_timed"] = config.self_timed_replay
    return Workload(requests, definition, counter.source, conversations, config.self_timed_replay)


def _drawn_output_lens(config: WorkloadConfig, ctx: DatasetContext, n: int) -> list[int] | None:
    if config.min_output_len is None or config.max_output_len is None:
        return None
    return draw_uniform_ints(ctx.rng("output"), config.min_output_len, config.max_output_len, n)


def _spec(index: int, draft: DraftRequest, drawn_output_len: int | None, config: WorkloadConfig) -> RequestSpec:
    output_len = drawn_output_len or draft.output_len or config.random_output_len
    return RequestSpec(
        index=index,
        prompt=draft.prompt,
        prompt_len=draft.prompt_len,
        output_len=output_len,
        min_output_len=output_len if config.exact_output_len else None,
        ignore_eos=config.sends_ignore_eos,
        extra_body=draft.extra_body,
        arrival_s=draft.arrival_s,
        session=draft.session,
        turn=draft.turn,
    )


def requests_digest(requests: list[RequestSpec]) -> str:
    """SHA-256 over every request's prompt and lengths: equal digests mean identical workloads."""
    digest = hashlib.sha256()
    for spec in requests:
        record: list[Any] = [spec.prompt, spec.prompt_len, spec.output_len, spec.min_output_len, spec.ignore_eos]
        if spec.arrival_s is not None:  # only then: earlier workloads keep their digests
            record.append(spec.arrival_s)
        if spec.extra_body:
            record.append(spec.extra_body)
        digest.update(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
    return digest.hexdigest()


def conversations_digest(conversations: list[ConversationSpec]) -> str:
    """SHA-256 over every conversation's turns (texts, lengths, think times) and output policy."""
    digest = hashlib.sha256()
    for conversation in conversations:
        turns = [[t.user_text, t.user_len, t.output_len, t.think_time_s] for t in conversation.turns]
        record = [turns, conversation.ignore_eos, conversation.exact_output_len]
        digest.update(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
    return digest.hexdigest()
