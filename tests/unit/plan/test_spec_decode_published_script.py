"""benchmarks/spec_decode_published.py: reading the published MTP rows and comparing the plan with them."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import load_benchmark_script


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark_script("spec_decode_published", monkeypatch)


def test_draft_counts_and_acceptance_are_read_from_the_rows(script: ModuleType) -> None:
    assert script.draft_tokens("mtp:3") == 3
    assert script.draft_tokens("mtp: NEXTN steps2 topk1 draft3") == 2  # SGLang's steps are the drafts
    assert script.draft_tokens("mtp:4 (topk1)") == 4
    assert script.draft_tokens("simulated-mtp") is None
    (rate,) = script.acceptance_from_note("overlap off; mean acceptance length 2.44; tp", "mtp:4", 4)
    assert 1 + sum(rate ** (i + 1) for i in range(4)) == pytest.approx(2.44, abs=1e-3)
    assert script.acceptance_from_note("", "mtp:1 (~90% acceptance)", 1) == [0.9]
    assert script.acceptance_from_note("random dataset", "mtp:3", 3) == []


def test_every_shipped_mtp_row_is_compared_or_says_why_not(script: ModuleType) -> None:
    comparisons = script.compare(script.load_rows())
    assert len(comparisons) == 115  # the research notes' MTP rows; their rows without MTP pair with them
    expressed = [c for c in comparisons if c.with_mtp is not None]
    assert all(c.why_not == "" for c in expressed) and all(c.why_not for c in comparisons if c.with_mtp is None)
    h200 = next(c for c in expressed if c.row.fields["metric"] == "output_throughput" and c.published > 150)
    assert h200.published == pytest.approx(158.07, abs=0.01)  # TensorRT-LLM, R1 FP8, 8 x H200, MTP 3, batch 1
    assert h200.with_mtp > h200.without_mtp * 1.5  # the plan's MTP gain at one user
    paired = [c for c in expressed if c.published_without is not None]
    assert paired and all(c.published_without > c.published for c in paired)  # latencies: MTP was faster
    assert "MTP rows expressed" in script.table(comparisons, markdown=True, everything=False)
