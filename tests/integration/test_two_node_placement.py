"""Placement by Ray resources: a two-node Ray cluster on this machine (ray.cluster_utils), one
node offering the custom resource `prefill`, the other `decode`, and a head that runs nothing.
The pools land on their own nodes, and requests are served through a KV pair that crosses
from one node to the other, with the offline engine's output."""

import pytest
import ray

from tests.integration.harness import (
    CHATS,
    ClusterHarness,
    cluster_config,
    greedy,
    offline_reference,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REQUESTS = [greedy(c, 16) for c in CHATS[:4]]


@pytest.fixture(scope="module")
def nodes():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    prefill = c.add_node(num_cpus=1, resources={"prefill": 1})
    decode = c.add_node(num_cpus=1, resources={"decode": 1})
    c.wait_for_nodes()
    yield c, prefill.node_id, decode.node_id
    c.shutdown()


@pytest.fixture(scope="module")
def cluster(nodes, tmp_path_factory):
    c, _, _ = nodes
    h = ClusterHarness(
        cluster_config(
            ray_address=c.address,
            engine={"dtype": "float32", "num_kv_blocks": 256},
            prefill={"replicas": 1, "cpus": 1, "resources": {"prefill": 1}},
            decode={"replicas": 1, "cpus": 1, "resources": {"decode": 1}},
            router={"port": 0},
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()
    ray.shutdown()


def node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id()))


def test_pools_are_placed_apart_and_serve_through_a_cross_node_pair(nodes, cluster):
    from workers.messages import Pool

    _, prefill_node, decode_node = nodes
    directory = cluster.cluster.router.fleet.directory
    [p] = directory.members(Pool.PREFILL)
    [d] = directory.members(Pool.DECODE)
    assert node_of(p.handle) == prefill_node
    assert node_of(d.handle) == decode_node
    results = cluster.generate_many(REQUESTS)
    assert [r.token_ids for r in results] == offline_reference(REQUESTS)
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w
