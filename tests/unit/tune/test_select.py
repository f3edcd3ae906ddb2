"""Choosing the best point: goodput among points whose SLOs hold, ties to fewer resources."""

from __future__ import annotations

from deepserve.engines.config import EngineConfig
from deepserve.results.slo import parse_slo
from deepserve.tune.search import Probe, SearchOutcome
from deepserve.tune.select import Scored, choose_best, ranking, resources, score
from tests.helpers import present
from tests.unit.tune.fake_points import batched_server_result


def scored(name: str, goodput: float, holds: bool = True, **config) -> Scored:
    return Scored(name, name, EngineConfig(**config), goodput, goodput, holds, ())


def test_highest_goodput_among_points_whose_slos_hold():
    best = choose_best([scored("a", 900), scored("b", 1000, holds=False), scored("c", 700)])
    assert best is not None and best.point_id == "a"


def test_no_point_holds_means_no_best():
    assert choose_best([scored("a", 900, holds=False)]) is None
    assert choose_best([]) is None


def test_ties_go_to_fewer_gpus_then_less_memory_then_smaller_batches():
    points = [
        scored("tp2", 1000, tensor_parallel_size=2, max_num_seqs=16),
        scored("big", 995, tensor_parallel_size=1, gpu_memory_utilization=0.95, max_num_seqs=16),
        scored("small", 990, tensor_parallel_size=1, gpu_memory_utilization=0.8, max_num_seqs=64),
        scored("smaller", 985, tensor_parallel_size=1, gpu_memory_utilization=0.8, max_num_seqs=32),
    ]
    best = choose_best(points, tie_margin=0.02)
    assert best is not None and best.point_id == "smaller"
    assert present(choose_best(points, tie_margin=0.0)).point_id == "tp2"


def test_an_engine_default_batch_counts_as_large():
    assert resources(EngineConfig(max_num_seqs=256)) < resources(EngineConfig())


def test_score_judges_the_run_against_the_slos():
    slos = [parse_slo("p99_ttft_ms=400")]
    small = score("s", "max_num_seqs=2", EngineConfig(max_num_seqs=2), batched_server_result(2, 16), slos)
    large = score("l", "max_num_seqs=16", EngineConfig(max_num_seqs=16), batched_server_result(16, 16), slos)
    assert not small.holds and large.holds
    assert large.goodput_output_tok_s == large.output_tok_s  # every request met the SLO
    assert small.goodput_output_tok_s < small.output_tok_s
    assert [item.point_id for item in ranking([small, large])] == ["l", "s"]


def test_with_a_search_the_best_run_that_held_is_what_counts():
    slos = [parse_slo("p99_ttft_ms=400")]
    probe = Probe(4, True, goodput_output_tok_s=300.0, output_tok_s=300.0, summary={"p99_ttft_ms": 150.0})
    search = SearchOutcome("max_concurrency", 4, 8, (probe,))
    item = score("s", "max_num_seqs=2", EngineConfig(max_num_seqs=2), batched_server_result(2, 16), slos, search)
    assert item.holds and item.goodput_output_tok_s == 300.0
    assert item.judged_at.startswith("4 concurrent requests")
    assert item.checks[0].value_ms == 150.0
