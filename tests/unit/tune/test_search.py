"""The load search: bisection between a load that held and one that missed, against servers with a known limit."""

from __future__ import annotations

import pytest

from deepserve.tune.search import Probe, SearchOptions, outcome_from_json, search_max_load


def server(limit: float, calls: list[float]):
    """The SLOs hold at loads up to LIMIT."""

    def measure(load: float) -> Probe:
        calls.append(load)
        return Probe(
            load, load <= limit, goodput_output_tok_s=load * 10 if load <= limit else 0.0, output_tok_s=load * 10
        )

    return measure


def test_rate_bisects_down_from_the_capacity_to_within_the_tolerance():
    calls: list[float] = []
    outcome = search_max_load(server(3.3, calls), SearchOptions("request_rate", steps=8, tolerance=0.05), start=10.0)
    assert calls[0] == 10.0
    assert outcome.max_load is not None and outcome.missed_above is not None
    assert outcome.max_load <= 3.3 < outcome.missed_above
    assert (outcome.missed_above - outcome.max_load) <= 0.05 * outcome.missed_above
    assert len(calls) <= 8
    assert outcome.best_probe is not None and outcome.best_probe.load == outcome.max_load


def test_rate_that_holds_at_the_capacity_stops_there():
    calls: list[float] = []
    outcome = search_max_load(server(100.0, calls), SearchOptions("request_rate"), start=10.0)
    assert calls == [10.0]
    assert outcome.max_load == 10.0 and outcome.missed_above is None
    assert "the rate the server completed" in outcome.words()


def test_steps_bound_the_runs():
    calls: list[float] = []
    search_max_load(server(0.01, calls), SearchOptions("request_rate", steps=3), start=10.0)
    assert calls == [10.0, 5.0, 2.5]


def test_nothing_holds():
    outcome = search_max_load(server(0.0, []), SearchOptions("request_rate", steps=3), start=8.0)
    assert outcome.max_load is None
    assert "missed at every load tried (down to 2 requests/s)" in outcome.words()


def test_concurrency_grows_while_the_slos_hold_then_bisects():
    calls: list[float] = []
    known = [Probe(4, True, 40.0, 40.0)]  # the point's own run at concurrency 4
    outcome = search_max_load(server(13, calls), SearchOptions("max_concurrency", steps=6), 4, known, ceiling=64)
    assert calls[:2] == [8, 16]  # doubling until a miss
    assert outcome.max_load == 13 and outcome.missed_above == 14
    assert all(float(load).is_integer() for load in calls)


def test_concurrency_growth_stops_at_the_ceiling():
    calls: list[float] = []
    outcome = search_max_load(server(1000, calls), SearchOptions("max_concurrency"), 16, [Probe(16, True, 1, 1)], 32)
    assert calls == [32]
    assert outcome.max_load == 32 and outcome.missed_above is None


def test_a_lucky_pass_above_a_miss_is_not_counted():
    probes = [Probe(8, False, 0, 1), Probe(12, True, 1, 1), Probe(4, True, 1, 1)]
    outcome = search_max_load(server(5, []), SearchOptions("max_concurrency", steps=0), 8, probes)
    assert outcome.max_load == 4 and outcome.missed_above == 8


def test_outcome_round_trips_through_json():
    outcome = search_max_load(server(3, []), SearchOptions("request_rate", steps=4), start=8.0)
    again = outcome_from_json(outcome.to_json())
    assert again == outcome


@pytest.mark.parametrize("axis", ["request_rate", "max_concurrency"])
def test_words_name_the_axis(axis):
    outcome = search_max_load(server(2, []), SearchOptions(axis, steps=4), start=8.0)
    assert ("requests/s" if axis == "request_rate" else "concurrent requests") in outcome.words()


def test_a_search_stored_by_an_earlier_deepserve_reads_back():
    """Its probes' goodput was stored as goodput_tok_s before the two goodputs got distinct names."""
    stored = {"axis": "max_concurrency", "max_load": 4, "missed_above": 8, "probes": [
        {"load": 4, "holds": True, "goodput_tok_s": 40.0, "output_tok_s": 40.0, "summary": {}},
    ]}  # fmt: skip
    outcome = outcome_from_json(stored)
    assert outcome.probes[0].goodput_output_tok_s == 40.0 and outcome.best_probe is outcome.probes[0]
