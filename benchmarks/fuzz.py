"""Hostile input against a real cluster: random bytes, bit flips, extreme and wrongly typed
fields, long stop lists, unknown ids and other tenants' ids, over gRPC and HTTP, with and
without keys.

    python benchmarks/fuzz.py [--grpc 20000] [--http 5000] [--seed 0] [--concurrency 32]

The cluster: one prefill and one decode worker on this machine, API keys for two tenants and
an admin, the OpenAI front on. It reports every status seen, by method; any status the API
does not document (INTERNAL, UNKNOWN, UNAVAILABLE; HTTP 5xx) with an example; whether every
worker is still alive and every KV block free afterwards; and the longest the router's event
loop was held (a 10 ms timer's lateness, sampled throughout). The test suite runs the same at
2,000 gRPC requests and 500 HTTP bodies (tests/integration/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402

from router.api import tandem_pb2 as pb  # noqa: E402

GRPC_DOCUMENTED = {
    "OK",
    "CANCELLED",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
}
HTTP_DOCUMENTED = {200, 400, 401, 403, 404, 405, 413, 429}
GEN = "/tandem.v1.Generation/"
ADMIN = "/tandem.v1.Admin/"


@dataclass
class Keys:
    """The cluster's keys, as the fuzzer uses them: two tenants and an admin."""

    a: str
    b: str
    admin: str


@dataclass
class Report:
    grpc: Counter = field(default_factory=Counter)  # "method STATUS" -> count
    http: Counter = field(default_factory=Counter)  # "path status" -> count
    undocumented: list[str] = field(default_factory=list)  # examples, a few per kind
    max_loop_lag_ms: float = 0.0
    max_size_loop_lag_ms: float = 0.0  # while the largest requests the limits let in arrive
    seconds: float = 0.0

    def bad(self) -> list[str]:
        return self.undocumented

    def to_json(self) -> dict:
        return {
            "grpc": dict(sorted(self.grpc.items())),
            "http": dict(sorted(self.http.items())),
            "undocumented": self.undocumented,
            "max_loop_lag_ms": round(self.max_loop_lag_ms, 1),
            "max_size_loop_lag_ms": round(self.max_size_loop_lag_ms, 1),
            "seconds": round(self.seconds, 1),
        }


# -- hostile values --------------------------------------------------------------------------
def _text(rng: random.Random, n: int) -> str:
    alphabet = ["a", " ", "\n", "é", "日", "🐝", "\u200b", ":", "/", "#", "\\", '"', "\x00", "<"]
    return "".join(rng.choice(alphabet) for _ in range(n))


def _extreme_int(rng: random.Random) -> int:
    return rng.choice([-(2**31), -1, 0, 1, 2, 7, 64, 65, 4096, 2**31 - 1])


def _extreme_float(rng: random.Random) -> float:
    return rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 0.5, 1.0, 2.0, 1e30, -1e-30])


def hostile_generate(rng: random.Random, other_ids: list[str]) -> pb.GenerateRequest:
    """A GenerateRequest with some fields extreme; a few come out valid (and short)."""
    msg = pb.GenerateRequest()
    roll = rng.random()
    if roll < 0.55:
        msg.prompt = _text(rng, rng.choice([0, 1, 5, 40, 300]))
    elif roll < 0.85:
        msg.prompt_ids.extend(
            rng.choice([0, 1, 5, 49151, 49152, 2**31 - 1]) for _ in range(rng.choice([0, 3, 40]))
        )
    elif roll < 0.95:
        msg.prompt = "x" * rng.choice([600_000, 900_000])  # past the prompt bytes limit
    if rng.random() < 0.3:
        msg.request_id = rng.choice(
            [_text(rng, rng.choice([1, 10, 70])), *other_ids, "ok-" + str(rng.random())]
        )
    if rng.random() < 0.2:
        msg.priority = _extreme_int(rng)
    s = msg.sampling
    s.max_tokens = rng.choice([-5, 0, 1, 4, 8, 10**9])
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        if rng.random() < 0.2:
            setattr(s, name, _extreme_float(rng))
    if rng.random() < 0.2:
        s.repetition_penalty = _extreme_float(rng)
    if rng.random() < 0.2:
        s.top_k = _extreme_int(rng)
    if rng.random() < 0.2:
        s.n = rng.choice([-1, 0, 1, 2, 4, 65, 1000])
    if rng.random() < 0.2:
        s.seed = rng.choice([0, 2**63 - 1, 12345])
    if rng.random() < 0.2:
        s.min_tokens = _extreme_int(rng) % 2**31
    if rng.random() < 0.2:
        s.top_logprobs = rng.choice([-1, 0, 5, 20, 21, 10**6])
        s.logprobs = rng.random() < 0.5
    if rng.random() < 0.2:
        for _ in range(rng.choice([1, 5, 2000])):
            s.logit_bias[rng.choice([0, 17, 49151, 49152, 2**31 - 1])] = _extreme_float(rng)
    if rng.random() < 0.25:
        count = rng.choice([1, 4, 17, 5000])
        s.stop.extend(_text(rng, rng.choice([0, 1, 3, 300])) for _ in range(count))
    if rng.random() < 0.2:
        s.stop_token_ids.extend(rng.randrange(0, 2**31) for _ in range(rng.choice([1, 300])))
    s.ignore_eos = rng.random() < 0.3
    return msg


def flip_bits(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def grpc_cases(rng: random.Random, n: int, keys: Keys, a_ids: list[str]):
    """(method, request bytes, key or None, streaming) for n hostile calls."""
    cases = []
    for _ in range(n):
        key = rng.choice([keys.a, keys.a, keys.b, None, "tdm-wrong-key"])
        kind = rng.random()
        if kind < 0.45:
            data = hostile_generate(rng, a_ids).SerializeToString()
            cases.append((GEN + "Generate", data, key, True))
        elif kind < 0.6:
            data = flip_bits(rng, hostile_generate(rng, a_ids).SerializeToString())
            cases.append((GEN + "Generate", data, key, True))
        elif kind < 0.7:
            data = rng.randbytes(rng.choice([0, 1, 7, 100, 3000]))
            method = rng.choice(["Generate", "Resume", "Cancel"])
            cases.append((GEN + method, data, key, method != "Cancel"))
        elif kind < 0.82:
            rid = rng.choice([*a_ids, _text(rng, 12), "never-was"])
            req = pb.ResumeRequest(
                request_id=rid, offset=rng.choice([0, 3, 2**31 - 1]), index=rng.choice([0, 1, 70])
            )
            cases.append((GEN + "Resume", req.SerializeToString(), key, True))
        elif kind < 0.92:
            rid = rng.choice([*a_ids, _text(rng, 12), "never-was"])
            cases.append((GEN + "Cancel", pb.CancelRequest(request_id=rid).SerializeToString(),
                          rng.choice([keys.b, None, "tdm-wrong-key"]), False))  # fmt: skip
        else:  # admin calls, never with the admin key: refused, the pools untouched
            method = rng.choice(["Status", "Scale", "Drain"])
            msg = {
                "Status": pb.StatusRequest(),
                "Scale": pb.ScaleRequest(pool="decode", replicas=rng.choice([0, 1, 100000])),
                "Drain": pb.DrainRequest(worker="decode-0", timeout_s=1),
            }[method]
            data = msg.SerializeToString() if rng.random() < 0.7 else rng.randbytes(20)
            cases.append((ADMIN + method, data, rng.choice([keys.a, None]), False))
    return cases


def http_cases(rng: random.Random, n: int, keys: Keys):
    """(method, path, body bytes, headers) for n hostile HTTP requests."""
    cases = []
    for _ in range(n):
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/models", "/nope"])
        key = rng.choice([keys.a, keys.b, keys.a, None, "tdm-wrong-key"])
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kind = rng.random()
        if kind < 0.15:
            body = rng.randbytes(rng.choice([0, 10, 1000]))
        elif kind < 0.25:
            depth = rng.choice([50, 5000, 100000])
            body = ("[" * depth + "]" * depth).encode()  # nesting past json's recursion
        elif kind < 0.3:
            body = b'{"prompt": "' + b"a" * rng.choice([10, 8_000_000]) + b'"}'
        else:
            # max_tokens small unless a mutation below says otherwise: a chat without one
            # runs to the end of the context, minutes on a CPU.
            doc = {
                "model": rng.choice(["SmolLM2-135M-Instruct", 3, None, "other"]),
                "max_tokens": 8,
            }
            if "chat" in path:
                doc["messages"] = rng.choice(
                    [[{"role": "user", "content": _text(rng, 20)}], [], "hi", [{"role": 5}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}, 7]}]]
                )  # fmt: skip
            else:
                doc["prompt"] = rng.choice([_text(rng, 20), [], [1, 2, -3], [[1]], 7, None])
            for name, values in (
                ("max_tokens", [-1, 0, 4, "8", 10**12, 1.5]),
                ("temperature", [-1, 0, "hot", 1e308, None]),
                ("n", [0, 2, 65, "two"]),
                ("stop", [["\n"] * 40, "x", 5, [None]]),
                ("logit_bias", [{"a": 1}, {"5": "x"}, [], {"999999": 1}]),
                ("stream", [True, "yes", 1]),
                ("logprobs", [True, 5, -1, "x"]),
                ("response_format", [{"type": "json_object"}]),
            ):
                if rng.random() < 0.3:
                    doc[name] = rng.choice(values)
            body = json.dumps(doc).encode()
        method = "GET" if path == "/v1/models" or rng.random() < 0.05 else "POST"
        cases.append((method, path, body, headers))
    return cases


def largest_requests(max_model_len: int) -> tuple[bytes, bytes]:
    """The costliest request each front reads in full: prompt text at the bytes limit, and
    every list at its limit (gRPC message bytes, HTTP body bytes). Refused, once tokenized,
    as longer than the context."""
    from router.edge import validation as v

    text = ("The quick brown fox. " * (v.prompt_bytes_limit(max_model_len) // 21 + 1))[
        : v.prompt_bytes_limit(max_model_len)
    ]
    stops = ["s" * v.MAX_STOP_CHARS] * v.MAX_STOP_STRINGS
    sampling = pb.SamplingParams(
        max_tokens=8,
        stop=stops,
        stop_token_ids=range(v.MAX_STOP_TOKEN_IDS),
        logit_bias={i: 1.0 for i in range(v.MAX_LOGIT_BIAS)},
    )
    grpc_bytes = pb.GenerateRequest(prompt=text, sampling=sampling).SerializeToString()
    body = {"prompt": text, "max_tokens": 8, "stop": stops[:4]}
    return grpc_bytes, json.dumps(body).encode()


# -- running them ----------------------------------------------------------------------------
async def loop_lag(stop: asyncio.Event, period_s: float = 0.01) -> float:
    """The longest a timer of period_s came late on this loop, in ms, until `stop` is set."""
    worst = 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        worst = max(worst, (time.perf_counter() - t0 - period_s) * 1e3)
    return worst


def _note(report: Report, kind: str, example: str) -> None:
    if sum(1 for u in report.undocumented if u.startswith(kind)) < 3:
        report.undocumented.append(f"{kind}: {example}"[:400])


async def run_grpc(address: str, cases, concurrency: int, report: Report, tls=None) -> None:
    from router.edge.tls import channel as tls_channel

    sem = asyncio.Semaphore(concurrency)
    async with tls_channel(address, tls) as ch:

        async def one(method, data, key, streaming):
            meta = [("authorization", f"Bearer {key}")] if key else None
            async with sem:
                code = "OK"
                try:
                    if streaming:
                        async for _ in ch.unary_stream(method)(data, timeout=60, metadata=meta):
                            pass
                    else:
                        await ch.unary_unary(method)(data, timeout=60, metadata=meta)
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                    if code not in GRPC_DOCUMENTED:
                        _note(report, f"{method} {code}", e.details() or "")
                report.grpc[f"{method.rsplit('/', 1)[1]} {code}"] += 1

        await asyncio.gather(*(one(*c) for c in cases))


async def run_http(url: str, cases, concurrency: int, report: Report, verify=True) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, verify=verify) as http:

        async def one(method, path, body, headers):
            async with sem:
                try:
                    r = await http.request(method, path, content=body, headers=headers)
                    status = r.status_code
                except httpx.HTTPError as e:  # the server closed on us: as bad as a 500
                    status = 0
                    _note(report, f"HTTP {path} connection", repr(e))
                if status not in HTTP_DOCUMENTED and status != 0:
                    _note(report, f"HTTP {path} {status}", body[:120].decode(errors="replace"))
                report.http[f"{path} {status}"] += 1

        await asyncio.gather(*(one(*c) for c in cases))


def _send(phase: str, address: str, http_url: str, keys: Keys, n_grpc: int, n_http: int,
          seed: int, concurrency: int, a_ids: list[str], max_model_len: int) -> dict:  # fmt: skip
    """One phase of the load, in a process of its own (so that the client's own work never
    holds the GIL of the router it measures): "largest" or "hostile". Returns the counts."""
    report = Report()
    if phase == "largest":
        grpc_big, http_big = largest_requests(max_model_len)
        big = [(GEN + "Generate", grpc_big, keys.a, True)] * 4
        asyncio.run(run_grpc(address, big, 4, report))
        body = [("POST", "/v1/completions", http_big, {"Authorization": f"Bearer {keys.a}"})]
        asyncio.run(run_http(http_url, body * 4, 4, report))
    else:
        rng = random.Random(seed)
        asyncio.run(run_grpc(address, grpc_cases(rng, n_grpc, keys, a_ids), concurrency, report))
        asyncio.run(run_http(http_url, http_cases(rng, n_http, keys), concurrency, report))
    return {"grpc": dict(report.grpc), "http": dict(report.http), "bad": report.undocumented}


def fuzz(run, address: str, http_url: str, keys: Keys, n_grpc: int, n_http: int, seed: int,
         concurrency: int = 32, a_ids: list[str] | None = None,
         max_model_len: int = 8192) -> Report:  # fmt: skip
    """The largest requests the limits let in, four of each, then the hostile cases, sent
    from a process of their own while the router's event loop is watched; `run(coro)` runs
    a coroutine on that loop (so that its lag is measured there) and blocks until it ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    report = Report()
    stop = asyncio.Event()

    async def watched():
        return asyncio.ensure_future(loop_lag(stop))

    async def stopped(task):
        stop.set()
        return await task

    args = (address, http_url, keys, n_grpc, n_http, seed, concurrency, a_ids or [],
            max_model_len)  # fmt: skip
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as client:
        for phase in ("largest", "hostile"):
            what = (
                "the largest requests"
                if phase == "largest"
                else f"{n_grpc} gRPC calls, {n_http} HTTP bodies"
            )
            print(f"[fuzz] sending {what}", flush=True)
            stop.clear()
            task = run(watched())
            t0 = time.perf_counter()
            got = client.submit(_send, phase, *args).result()
            lag = run(stopped(task))
            report.grpc.update(got["grpc"])
            report.http.update(got["http"])
            report.undocumented += got["bad"]
            if phase == "largest":
                report.max_size_loop_lag_ms = lag
            else:
                report.max_loop_lag_ms, report.seconds = lag, time.perf_counter() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grpc", type=int, default=20000)
    ap.add_argument("--http", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz.json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.integration.harness import fuzz_cluster

    with fuzz_cluster(ROOT / "benchmarks" / "results" / "fuzz-data") as (h, texts, a_ids):
        keys = Keys(*texts)
        url = f"http://127.0.0.1:{h.cluster.http_port}"
        report = fuzz(h.run, h.address, url, keys, args.grpc, args.http, args.seed,
                      args.concurrency, a_ids)  # fmt: skip
        after = h.wait_all_free()
    workers = after["prefill"] + after["decode"]
    held = sum(w["kv_blocks_total"] - w["kv_blocks_free"] for w in workers)
    restarts = sum(p.get("restarts", 0) for p in after["pools"].values())
    print(f"{args.grpc} gRPC calls, {args.http} HTTP requests in {report.seconds:.0f} s")
    print(f"{'status':<34} {'count':>7}")
    for k, v in sorted({**report.grpc, **report.http}.items()):
        print(f"{k:<34} {v:>7}")
    print(f"undocumented statuses: {len(report.undocumented)}; blocks held after: {held}; "
          f"worker restarts: {restarts}; longest event-loop hold: "
          f"{report.max_loop_lag_ms:.0f} ms (under the largest requests: "
          f"{report.max_size_loop_lag_ms:.0f} ms)")  # fmt: skip
    for u in report.undocumented:
        print("  " + u)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({**report.to_json(), "blocks_held_after": held, "restarts": restarts}, indent=2)
    )
    print(f"wrote {args.out}")
    return 1 if report.undocumented or held or restarts else 0


if __name__ == "__main__":
    sys.exit(main())
