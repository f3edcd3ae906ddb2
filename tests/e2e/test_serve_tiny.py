"""`deepserve serve` on real vLLM (CPU build) with the tiny DeepSeek-V3-architecture model, called with the
official openai client. The tiny tokenizer is byte-level with a BOS, so prompt token counts are exact."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from tests.e2e.conftest import ServedTiny, free_port, start_deepserve

IGNORE_EOS = {"ignore_eos": True}  # random weights may sample EOS early; counts must be exact


@pytest.fixture(scope="module")
def client(served_tiny: ServedTiny) -> OpenAI:
    return OpenAI(base_url=served_tiny.base_url, api_key="unused", timeout=120)


def test_models_lists_the_served_name(client: OpenAI, served_tiny: ServedTiny) -> None:
    assert [model.id for model in client.models.list()] == [served_tiny.model]
    assert served_tiny.model == "deepserve/tiny-deepseek-v3"


def test_completion_token_counts(client: OpenAI, served_tiny: ServedTiny) -> None:
    response = client.completions.create(model=served_tiny.model, prompt="Hello", max_tokens=16, extra_body=IGNORE_EOS)
    assert response.usage is not None
    assert response.usage.prompt_tokens == 1 + len(b"Hello")  # BOS + one token per byte
    assert response.usage.completion_tokens == 16
    assert response.choices[0].finish_reason == "length"


def test_chat_completion_uses_deepseek_chat_format(client: OpenAI, served_tiny: ServedTiny) -> None:
    response = client.chat.completions.create(
        model=served_tiny.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        extra_body=IGNORE_EOS,
    )
    assert response.usage is not None
    # <｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>
    assert response.usage.prompt_tokens == 1 + 1 + 2 + 1
    assert response.usage.completion_tokens == 8
    assert response.choices[0].message.role == "assistant"


def test_streamed_chat_completion_reports_usage(client: OpenAI, served_tiny: ServedTiny) -> None:
    stream = client.chat.completions.create(
        model=served_tiny.model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about MLA."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens == 1 + len(b"Be brief.") + 1 + len(b"Tell me about MLA.") + 1
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content is not None]
    # at most one per token (plus the role chunk), never more; a starved API server merges pending deltas, so a
    # single chunk can carry them all
    assert 1 <= len(token_chunks) <= 13
    assert chunks[-2].choices[0].finish_reason == "length"


def test_engine_death_exits_nonzero_with_log_tail(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--port", str(free_port()), "--", "--no-such"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={"DEEPSERVE_HOME": str(tmp_path), "PATH": ""}
    )
    assert result.returncode == 2
    assert "the engine exited with code" in result.stderr
    assert "--no-such" in result.stderr  # vLLM's own complaint, from the log tail
    assert "hint:" in result.stderr


def test_sigint_stops_the_service_and_every_engine_process(tmp_path: Path) -> None:
    served = start_deepserve(tmp_path)
    tree = served.process_tree()
    assert len(tree) >= 3  # deepserve, the API server, its engine core (and workers)
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(proc.is_running() for proc in tree):
        time.sleep(0.5)
    leftovers = [proc.pid for proc in tree if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]
    assert leftovers == []
