"""The prefix router's ranking on its own, inside a real local Ray instance (its replicas are real named
actors, which is what Ray Serve's RunningReplica looks up): requests ranked together before any is sent spread
over the replicas, a request's first choice stops counting once it is sent or completes, and a conversation's
next turn goes to the replica that answered its first."""

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow  # a Ray instance starts

import ray  # noqa: E402
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve._private.constants import SERVE_NAMESPACE  # noqa: E402
from ray.serve.request_router import PendingRequest, RunningReplica  # noqa: E402

from moestream.distributed.prefix_router import ROUTE_KWARG, PrefixAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine")


@ray.remote(num_cpus=0)
class Replica:
    def ping(self) -> str:
        return "up"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[RunningReplica]]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
    try:
        actors = [Replica.options(name=n, namespace=SERVE_NAMESPACE).remote() for n in ("a", "b")]
        ray.get([a.ping.remote() for a in actors])
        infos = [RunningReplicaInfo(replica_id=ReplicaID(unique_id=n, deployment_id=DEPLOYMENT), node_id=None,
                                    node_ip=None, availability_zone=None, actor_name=n, max_ongoing_requests=8)
                 for n in ("a", "b")]  # fmt: skip
        yield [RunningReplica(info) for info in infos]
    finally:
        ray.shutdown()


def _router() -> PrefixAffinityRouter:
    """A router as Ray Serve makes one: on the event loop it runs in."""

    async def make() -> PrefixAffinityRouter:
        router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        return router

    loop = asyncio.new_event_loop()
    router = loop.run_until_complete(make())
    router.test_loop = loop
    return router


def _request(i: int, keys: list[str]) -> PendingRequest:
    meta = RequestMetadata(request_id=str(i), internal_request_id=f"req-{i}")
    return PendingRequest(args=[], kwargs={ROUTE_KWARG: keys}, metadata=meta)


def _first_choice(router: PrefixAffinityRouter, reps: list[RunningReplica], request: PendingRequest) -> Any:
    ranks = router.test_loop.run_until_complete(router.choose_replicas(reps, request))
    return ranks[0][0].replica_id


def test_requests_ranked_together_spread_over_the_replicas(replicas):
    router = _router()
    firsts = [_first_choice(router, replicas, _request(i, [f"conv-{i}"])) for i in range(4)]
    assert sorted(r.unique_id for r in firsts) == ["a", "a", "b", "b"]
    again = _first_choice(router, replicas, _request(0, ["conv-0"]))  # ranked again: counted once
    assert [router.load_of(r.replica_id) for r in replicas] == [2, 2] and again == firsts[0]


def test_a_sent_request_counts_once_and_a_finished_one_leaves_its_prefix(replicas):
    router = _router()
    a, b = (r.replica_id for r in replicas)
    first = _first_choice(router, replicas, _request(0, ["conv-0"]))
    router.on_send_request(first)
    assert router.load_of(first) == 1 and router.ranked == {}
    router.on_request_completed(first, "req-0")
    assert router.load_of(first) == 0
    # the next turn shares the first key: it goes to the replica that answered, even when it is busier
    other = b if first == a else a
    router.on_send_request(first)
    assert _first_choice(router, replicas, _request(1, ["conv-0", "conv-0-turn-2"])) == first
    assert router.load_of(first) == 2 and router.load_of(other) == 0


def test_a_request_sent_elsewhere_stops_counting_when_it_completes(replicas):
    router = _router()
    first = _first_choice(router, replicas, _request(0, ["conv-0"]))
    other = next(r.replica_id for r in replicas if r.replica_id != first)
    router.on_send_request(other)  # its first choice refused it: Ray Serve sent it to the next rank
    assert router.load_of(first) == 1 and router.load_of(other) == 1
    router.on_request_completed(other, "req-0")
    assert router.load_of(first) == 0 and router.load_of(other) == 0
