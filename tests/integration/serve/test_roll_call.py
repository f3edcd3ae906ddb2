"""The roll call between node 0 and the worker nodes, over real sockets on loopback."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.engines.nodes import CheckIn, HeadStopped, RollCall, deployment_of
from deepserve.errors import ConfigError, EngineError
from deepserve.net import free_port
from tests.helpers import wait_until


def node(rank: int, nnodes: int, port: int, **fields: object) -> EngineConfig:
    return EngineConfig.model_validate(
        {"nnodes": nnodes, "node_rank": rank, "master_addr": "127.0.0.1", "join_port": port, "join_timeout_s": 5}
        | fields
    )


@pytest.fixture
def head() -> Iterator[RollCall]:
    roll = RollCall(node(0, 3, free_port(), pipeline_parallel_size=3), bind_host="127.0.0.1").start()
    yield roll
    roll.stop("test over")


def join(head: RollCall, rank: int, **fields: object) -> CheckIn:
    fields = {"pipeline_parallel_size": 3} | fields
    check_in = CheckIn(node(rank, head.config.nnodes, head.port, **fields), host_name=f"host{rank}")
    check_in.join()
    return check_in


def test_nodes_join_learn_readiness_and_follow_a_stop(head: RollCall) -> None:
    assert head.missing() == [1, 2]
    first = join(head, 1)
    assert head.missing() == [2]
    head.announce_ready("http://10.0.0.1:8000/v1")
    wait_until(lambda: first.ready_url == "http://10.0.0.1:8000/v1")
    late = join(head, 2)  # joining after the service is ready still learns where it is
    wait_until(lambda: late.ready_url == "http://10.0.0.1:8000/v1")
    assert head.missing() == []
    head.stop("node 0 is stopping")
    wait_until(lambda: first.stop_reason is not None and late.stop_reason is not None)
    for check_in in (first, late):
        with pytest.raises(HeadStopped, match="node 0 stopped the service"):
            check_in.raise_if_head_gone()
    assert head.left == []  # a stop on purpose is not a node leaving


def test_a_node_started_with_another_deployment_is_refused_with_the_difference(head: RollCall) -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size: node 0 has 3, this node 2"):
        join(head, 1, pipeline_parallel_size=2)
    assert head.missing() == [1, 2]


def test_a_rank_taken_twice_is_refused(head: RollCall) -> None:
    join(head, 1)
    with pytest.raises(ConfigError, match="node rank 1 has already joined"):
        join(head, 1)


@pytest.mark.parametrize("same_deployment", [True, False], ids=["would-be-admitted", "refused"])
def test_a_node_whose_connection_fails_before_the_answer_is_not_kept(head: RollCall, same_deployment: bool) -> None:
    ours, theirs = socket.socketpair()
    ours.close()  # the answer cannot be sent: the node is gone before it hears it
    deployment = deployment_of(head.config) | ({} if same_deployment else {"max_model_len": 4096})
    join_line = "JOIN " + json.dumps({"rank": 1, "host": "gone", "deployment": deployment})
    assert head.admit(ours, join_line.encode()) is None
    assert head.missing() == [1, 2]
    theirs.close()


def test_a_worker_that_leaves_is_reported_by_node_zero(head: RollCall) -> None:
    leaving = join(head, 1)
    leaving.close()
    wait_until(lambda: bool(head.left))
    with pytest.raises(EngineError, match="node 1 left the deployment"):
        head.raise_if_one_left()


def test_a_worker_notices_node_zero_vanishing_without_a_stop() -> None:
    port = free_port()
    roll = RollCall(node(0, 2, port), bind_host="127.0.0.1").start()
    worker = CheckIn(node(1, 2, port))
    worker.join()
    roll.close()  # a crash: the OS drops the connections, no STOP is sent
    wait_until(lambda: worker.head_gone)
    with pytest.raises(EngineError, match="went away"):
        worker.raise_if_head_gone()


def test_a_worker_gives_up_on_a_node_zero_that_never_answers() -> None:
    config = node(1, 2, free_port(), join_timeout_s=0.5)
    seen: list[str] = []
    with pytest.raises(EngineError, match="did not answer within 0 s"):
        CheckIn(config).join(lambda phase, _elapsed: seen.append(phase))
    assert seen and "waiting for node 0 at 127.0.0.1" in seen[0]
