"""Hostile input against a real cluster (benchmarks/fuzz.py at the suite's size): 2,000 gRPC
calls and 500 HTTP bodies of random bytes, bit flips, extreme and wrongly typed fields, long
stop lists, unknown ids and another tenant's ids, with and without keys. Every answer is a
documented status, no worker dies, no KV block is held after, and the router's event loop is
never held past 200 ms, under the hostile load or the largest requests the limits let in."""

import pytest

from benchmarks.fuzz import Keys, fuzz
from tests.integration.harness import fuzz_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_hostile_requests_get_documented_answers_and_leave_nothing_behind(tmp_path):
    with fuzz_cluster(tmp_path) as (h, texts, a_ids):
        keys = Keys(*texts)
        url = f"http://127.0.0.1:{h.cluster.http_port}"
        report = fuzz(h.run, h.address, url, keys, 2000, 500, seed=1, a_ids=a_ids)
        after = h.wait_all_free()
        msg = pb_request()
        still = h.run(h.client.generate(msg, timeout_s=120))
    assert report.undocumented == [], report.undocumented
    assert sum(report.grpc.values()) == 2004 and sum(report.http.values()) == 504  # and 4 largest
    assert any(k.endswith(" OK") for k in report.grpc)  # some were valid, and served
    for w in after["prefill"] + after["decode"]:
        assert w["alive"] and w["kv_blocks_free"] == w["kv_blocks_total"], w
        assert w["reserved"] == 0, w
    assert all(p["restarts"] == 0 for p in after["pools"].values()), after["pools"]
    assert report.max_loop_lag_ms < 200, report.to_json()
    assert report.max_size_loop_lag_ms < 200, report.to_json()
    # The largest requests were read whole and refused as longer than the context.
    assert report.grpc["Generate INVALID_ARGUMENT"] >= 4 and report.http["/v1/completions 400"] >= 4
    assert still.status == "OK" and still.token_ids  # and the router still serves


def pb_request():
    from router.api import tandem_pb2 as pb

    return pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=4))
