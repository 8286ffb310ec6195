"""Who gets responsiveness when the cluster is full: each scheduling policy side by side, in
one run, on real Tandem clusters (Ray workers, the router over gRPC on loopback, Redis).

    python benchmarks/fairness.py [--out F] [--scenarios noisy,weights,starvation,sjf,slo]
        [--scale 1.0] [--repeats 3]

Scenarios (each prints a table; all go to one JSON, and one PNG beside it):
- noisy: tenant B sends a steady stream of chats; tenant A floods long requests at 10x its
  share (5x the rate the cluster serves them alone, measured first). B's TTFT and TPOT p90
  alone, then with A flooding under fair share (the router's and the engines'), and under
  FCFS (both off), each on a cluster of its own config; with A flooding, B's requests carry
  a TPOT target (tpot_slo_ms) of 1.3x its TPOT alone. Both clusters run decode-first
  (engine.prefill_share 0.25); a third, fair but prefill-first (prefill_share 1), shows what
  decode-first is worth. Each is run --repeats times (B alone interleaved with fair share),
  after a few unmeasured seconds of both; medians reported.
- weights: three tenants of weights 1:2:4, all saturating: each one's share of the output
  tokens over a window where all are busy, against its weight's share.
- starvation: one long request among a stream of short ones that never lets up (sent at
  1.25x the rate the cluster serves them, measured first, whatever the machine): its wait
  for a first token under SJF without and with router.admission_max_wait_s, and under
  priority (it the least urgent) without and with admission_aging_per_s.
- sjf: a heavy-tailed workload (output length set by the kind of request, one kind per
  tenant, ended by EOS), at 1.3x the rate the cluster serves it (measured first): completion
  time (arrival to last token) under FCFS, SJF by prompt length, SJF by predicted length
  (the router's predictor, learned online) and SJF by the true length (the oracle, from the
  FCFS run: greedy outputs repeat exactly); the predictor's mean absolute error.
- slo: interactive chats (tight TTFT SLO) and batch requests (loose) at Poisson arrivals,
  at 1x and 1.5x the rate the cluster serves that mix saturated (measured first): goodput
  (requests per second meeting both SLOs) under FCFS against slack ordering with
  reject_if_late.

Clusters are colocated (one worker with both cores, chunked prefill, max_num_seqs seats) so
that one engine's scheduler is measured, not two processes sharing two cores; the router's
slots (max_in_flight) are few where the router's order is measured (starvation, sjf, slo)
and many where the engine's is (noisy, weights). The router runs in this process, the clients
in another, as they would. Timings are this machine's: compare ratios within the run, never
figures across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, ROOT, log, percentile, print_table  # noqa: E402
from benchmarks.make_workloads import STYLES, TOPICS  # noqa: E402

SCENARIOS = ("noisy", "weights", "starvation", "sjf", "slo")
FILLER = (
    "Here is some background you may use. The history of science is full of ideas that "
    "seemed strange at first and later became common sense, and of careful measurements "
    "that overturned what everybody believed. "
)


# -- requests and their outcomes -------------------------------------------------------------
@dataclass
class Job:
    at: float  # seconds after the phase starts
    tenant: str
    prompt: str
    max_tokens: int
    ignore_eos: bool = True
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    reject_if_late: bool = False
    kind: str = ""


@dataclass
class Outcome:
    job: Job
    status: str = "OK"
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # since the phase's start

    @property
    def tpot_s(self) -> float | None:
        if self.tokens < 2 or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def meets(self) -> bool:
        j = self.job
        if self.status != "OK" or self.ttft_s is None:
            return False
        if j.ttft_slo_ms is not None and self.ttft_s * 1e3 > j.ttft_slo_ms:
            return False
        tpot = self.tpot_s
        return j.tpot_slo_ms is None or tpot is None or tpot * 1e3 <= j.tpot_slo_ms


def message(j: Job):
    from router.api import tandem_pb2 as pb

    sp = pb.SamplingParams(max_tokens=j.max_tokens, temperature=0.0, ignore_eos=j.ignore_eos)
    msg = pb.GenerateRequest(prompt=j.prompt, sampling=sp, tenant=j.tenant, priority=j.priority)
    if j.ttft_slo_ms is not None:
        msg.ttft_slo_ms = j.ttft_slo_ms
    if j.tpot_slo_ms is not None:
        msg.tpot_slo_ms = j.tpot_slo_ms
    msg.reject_if_late = j.reject_if_late
    return msg


_clients: ProcessPoolExecutor | None = None


async def run_jobs(address: str, jobs: list[Job], until=None, timeout_s: float = 300) -> list:
    """Send every job at its time; returns their outcomes. `until(outcomes)` (picklable):
    once true (checked as jobs end), the jobs still running are cancelled (their outcome
    CANCELLED). The jobs are sent from a process of their own, as clients are: the load
    generator's streams never take the event loop of the router, which runs in this one."""
    global _clients
    if _clients is None:
        _clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_clients, _send_jobs, address, jobs, until, timeout_s)


def _send_jobs(address: str, jobs: list[Job], until, timeout_s: float) -> list:
    return asyncio.run(_send_jobs_async(address, jobs, until, timeout_s))


def tenant_done(tenant: str, outcomes: list) -> bool:
    """Every request of `tenant` has ended (an `until` for run_jobs)."""
    return all(o.status != "OK" or o.e2e_s is not None for o in outcomes if o.job.tenant == tenant)


def token_past(t: float, outcomes: list) -> bool:
    """Some request has had a token later than t seconds into the run (an `until`)."""
    return any(o.token_times and o.token_times[-1] > t for o in outcomes)


async def _send_jobs_async(address: str, jobs: list[Job], until, timeout_s: float) -> list:
    from client import TandemClient

    client = TandemClient(address)
    t0 = time.perf_counter()
    outcomes = [Outcome(j) for j in jobs]
    done = asyncio.Event()

    async def one(o: Outcome) -> None:
        await asyncio.sleep(max(0.0, t0 + o.job.at - time.perf_counter()))
        sent = time.perf_counter()
        try:
            r = await client.generate(message(o.job), timeout_s=timeout_s)
        except asyncio.CancelledError:
            o.status = "CANCELLED"
            raise
        o.status, o.ttft_s, o.e2e_s = r.status, r.ttft_s, r.e2e_s
        o.tokens = len(r.token_ids)
        o.token_times = [sent - t0 + t for t in r.token_times]
        if until is not None and until(outcomes):
            done.set()

    tasks = [asyncio.create_task(one(o)) for o in outcomes]
    waiter = asyncio.create_task(done.wait())
    everything = asyncio.gather(*tasks, return_exceptions=True)
    try:
        await asyncio.wait([everything, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in [*tasks, waiter]:
            t.cancel()
        await asyncio.gather(everything, waiter, return_exceptions=True)
        await client.close()
    for o in outcomes:
        if o.status == "OK" and o.ttft_s is None:
            o.status = "CANCELLED"
    return outcomes


def ms(x: float) -> float:
    return round(1e3 * x, 1)


# -- clusters --------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def cluster(name: str, *, fair: bool, seats: int, slots: int, prefill_share: float = 1.0):
    from cluster import config_io
    from cluster.cluster import Cluster
    from cluster.config import ClusterConfig

    data_dir = RESULTS / f"fairness-data-{name}"
    # A fresh Redis: requests an earlier run left would be adopted and replayed here.
    shutil.rmtree(data_dir, ignore_errors=True)
    values = dict(
        mode="colocated",
        dashboard=False,
        data_dir=str(data_dir),
        decode=dict(replicas=1, cpus=2),
        engine=dict(
            dtype="bfloat16",
            kv_cache_gb=1.0,
            max_num_seqs=seats,
            prefill_chunk_size=256,
            max_num_batched_tokens=256,
            fair_share=fair,
            prefill_share=prefill_share,
        ),
        router=dict(port=0, max_in_flight=slots, admission_fair_share=fair, max_queue=4096),
    )
    cfg = config_io.build(ClusterConfig, values, name)
    log(
        f"[{name}] starting: colocated, {seats} seats, {slots} router slots, fair share {fair}, "
        f"prefill_share {prefill_share}"
    )
    c = await Cluster(cfg).start(progress=lambda m: log(f"  {m}"))
    try:
        await run_jobs(c.address, [Job(0, "warm", "Say hi.", 4)])  # warm-up
        yield c
    finally:
        await c.stop()


async def idle(c, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until no worker runs or queues anything: what the last run cancelled
    has ended, and does not slow the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = await c.router.fleet.snapshot(5.0)
        if all(w.running == 0 and w.waiting == 0 for w in workers):
            return
        await asyncio.sleep(0.2)
    log(f"workers still busy after {timeout_s:.0f} s: going on")


def set_router(c, **changes) -> None:
    c.router.config = replace(c.router.config, **changes)


# -- workloads -------------------------------------------------------------------------------
def chat(rng: random.Random) -> str:
    return rng.choice(STYLES[:3]).format(t=rng.choice(TOPICS))


def long_prompt(rng: random.Random, repeats: int) -> str:
    return FILLER * repeats + rng.choice(STYLES).format(t=rng.choice(TOPICS))


def spaced(rate: float, n: int, start: float = 0.0) -> list[float]:
    return [start + i / rate for i in range(n)]


def poisson(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# -- scenarios -------------------------------------------------------------------------------
async def noisy(scale: float, repeats: int) -> dict:
    rng = random.Random(1)
    n_b = max(8, int(24 * scale))
    b = [Job(t, "b", chat(rng), 48, kind="chat") for t in spaced(0.7, n_b, 1.0)]
    span = b[-1].at
    longs = [Job(0.0, "a", long_prompt(rng, 8), 192, kind="long") for _ in range(256)]

    b_done = functools.partial(tenant_done, "b")

    def summary(outs) -> dict:
        bs = [o for o in outs if o.job.tenant == "b"]
        ok = [o for o in bs if o.status == "OK"]
        return {
            "b_requests": len(bs),
            "b_completed": len(ok),
            "b_ttft_p90_ms": ms(percentile([o.ttft_s for o in ok], 90)),
            "b_tpot_p90_ms": ms(percentile([o.tpot_s for o in ok], 90)),
            "b_ttft_p50_ms": ms(percentile([o.ttft_s for o in ok], 50)),
            "b_tpot_p50_ms": ms(percentile([o.tpot_s for o in ok], 50)),
            "a_tokens": sum(o.tokens for o in outs if o.job.tenant == "a"),
        }

    runs: dict[str, list[dict]] = {"alone": [], "fair": [], "fcfs": [], "fair_prefill_first": []}
    # Decode-first (prompts take at most a quarter of a step beside decodes), the same on
    # both clusters: a flood's long prompts do not stretch the steps the others decode in.
    async with cluster("noisy-fair", fair=True, seats=8, slots=256, prefill_share=0.25) as c:
        # A: long prompts and answers, sent for as long as B sends at 10x its share of two
        # tenants (5x the rate the cluster serves them alone, measured first).
        cap = await capacity(c, "noisy", longs[:16])
        a_rate = 5 * cap
        times = spaced(a_rate, int(a_rate * span))
        a = [replace(longs[i % len(longs)], at=t) for i, t in enumerate(times)]
        # A few seconds of both, unmeasured, before each cluster's first run: the batch shapes
        # a flood makes are set up once (oneDNN, allocator), not inside a measured run.
        warm = [j for j in sorted(a + b, key=lambda j: j.at) if j.at < 4.0]
        await run_jobs(c.address, warm, b_done)
        for r in range(repeats):
            await idle(c)
            log(f"[noisy] {r + 1}/{repeats}: B alone")
            runs["alone"].append(summary(await run_jobs(c.address, b)))
            if r == 0:
                # B asks for a TPOT of 1.3x what it gets alone (tpot_slo_ms), as an interactive
                # tenant states its target; A states none. The same requests go to every run.
                target = round(1.3 * runs["alone"][0]["b_tpot_p50_ms"], 1)
                b = [replace(j, tpot_slo_ms=target) for j in b]
                flood = sorted(a + b, key=lambda j: j.at)
            await idle(c)
            log(f"[noisy] {r + 1}/{repeats}: B (tpot_slo_ms {target}) with A flooding, fair share")
            runs["fair"].append(summary(await run_jobs(c.address, flood, b_done)))
    for name, fair, share in (("fcfs", False, 0.25), ("fair_prefill_first", True, 1.0)):
        async with cluster(f"noisy-{name}", fair=fair, seats=8, slots=256,
                           prefill_share=share) as c:  # fmt: skip
            await run_jobs(c.address, warm, b_done)
            for r in range(repeats):
                await idle(c)
                log(f"[noisy] {r + 1}/{repeats}: B with A flooding, {name} (prefill_share {share})")
                runs[name].append(summary(await run_jobs(c.address, flood, b_done)))
    # Each figure is the median over the repeats; a ratio, the median of each repeat's ratio
    # to the run of B alone of the same repeat (the machine drifts between repeats).
    out: dict = {
        "repeats": repeats,
        "b_tpot_slo_ms": target,
        "a_capacity_per_s": cap,
        "a_per_s": round(a_rate, 2),
        "runs": runs,
    }
    for name, rs in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        if name == "alone":
            continue
        for m in ("ttft", "tpot"):
            key = f"b_{m}_p90_ms"
            ratios = [r[key] / alone[key] for r, alone in zip(rs, runs["alone"])]
            out[name][f"b_{m}_p90_vs_alone"] = round(statistics.median(ratios), 2)
    print(f"\nnoisy neighbour: tenant B's latency (ms), A flooding long requests; median of "
          f"{repeats} runs, each ratio against B alone in the same repeat")  # fmt: skip
    print_table(
        ["run", "B TTFT p50", "B TTFT p90", "x alone", "B TPOT p50", "B TPOT p90", "x alone"],
        [
            [
                k,
                out[k]["b_ttft_p50_ms"],
                out[k]["b_ttft_p90_ms"],
                out[k].get("b_ttft_p90_vs_alone", 1.0),
                out[k]["b_tpot_p50_ms"],
                out[k]["b_tpot_p90_ms"],
                out[k].get("b_tpot_p90_vs_alone", 1.0),
            ]
            for k in runs
        ],  # fmt: skip
    )
    return out


async def weights(scale: float) -> dict:
    rng = random.Random(2)
    w = {"w1": 1.0, "w2": 2.0, "w4": 4.0}
    # Each tenant has more than the window can serve: none runs dry inside it.
    window = (8.0, 8.0 + 40.0 * scale)
    n = max(24, int(120 * scale))
    jobs = [Job(0.02 * i, t, chat(rng), 64) for i in range(n) for t in w]

    past_window = functools.partial(token_past, window[1])

    async with cluster("weights", fair=True, seats=8, slots=256) as c:
        for t, wt in w.items():  # as `tandem tenants --set` does
            c.router.admission.tenants.update(t, weight=wt)
        log(f"[weights] three tenants, weights {w}, saturating")
        outs = await run_jobs(c.address, jobs, past_window)
    # The window ends early if a tenant's backlog ran out inside it: then it is not saturating.
    last = {t: max((x for o in outs if o.job.tenant == t for x in o.token_times), default=0.0)
            for t in w}  # fmt: skip
    window = (window[0], min(window[1], *last.values()))
    tokens = {t: 0 for t in w}
    for o in outs:
        tokens[o.job.tenant] += sum(1 for x in o.token_times if window[0] <= x < window[1])
    total, wsum = sum(tokens.values()), sum(w.values())
    rows, errors = [], {}
    for t, wt in w.items():
        share, want = tokens[t] / max(1, total), wt / wsum
        errors[t] = abs(share - want) / want
        rows.append([t, wt, tokens[t], f"{share:.3f}", f"{want:.3f}", f"{errors[t]:.1%}"])
    print("\nweights: output tokens in the window where all three saturate")
    print_table(["tenant", "weight", "tokens", "share", "weight's share", "error"], rows)
    return {
        "weights": w,
        "window_s": list(window),
        "tokens": tokens,
        "share_error": {t: round(e, 4) for t, e in errors.items()},
        "max_share_error": round(max(errors.values()), 4),
    }


async def starvation(c, scale: float) -> dict:
    rng = random.Random(3)
    span = 40.0 * scale
    set_router(c, admission_policy="fcfs", admission_fair_share=False)
    cap = await capacity(c, "starvation", [Job(0, "s", chat(rng), 24) for _ in range(32)])
    # Short requests at 1.25x what two slots serve: the queue never empties while they come.
    rate = 1.25 * cap
    shorts = [Job(t, "s", chat(rng), 24, kind="short") for t in spaced(rate, int(rate * span))]
    longest = Job(1.0, "s", long_prompt(rng, 12), 96, kind="longest")
    jobs = sorted([*shorts, longest], key=lambda j: j.at)
    out = {}
    runs = [  # (name, policy, admission_max_wait_s, admission_aging_per_s)
        ("sjf", "sjf", None, 0.0),
        ("sjf_max_wait", "sjf", 5.0, 0.0),
        ("priority", "priority", None, 0.0),  # the long one at priority 10, the rest at 0
        ("priority_aging", "priority", None, 1.0),  # 1 a second: level with them after 10 s
    ]
    for name, policy, max_wait, aging in runs:
        set_router(c, admission_policy=policy, admission_fair_share=False,
                   admission_max_wait_s=max_wait, admission_aging_per_s=aging)  # fmt: skip
        log(f"[starvation] {name}: one long request among a stream of short ones")
        run = [replace(j, priority=10 if j.kind == "longest" else 0) for j in jobs]
        outs = await run_jobs(c.address, run)
        lo = next(o for o in outs if o.job.kind == "longest")
        out[name] = {
            "max_wait_s": max_wait,
            "aging_per_s": aging,
            "longest_wait_ms": ms(lo.ttft_s) if lo.ttft_s is not None else None,
            "short_ttft_p90_ms": ms(
                percentile([o.ttft_s for o in outs if o.job.kind == "short"], 90)
            ),
            "stream_s": span,
            "shorts_per_s": round(rate, 2),
        }
    set_router(c, admission_max_wait_s=None, admission_aging_per_s=0.0)
    print(
        f"\nstarvation: one long request among short ones that never let up ({rate:.1f}/s, "
        "1.25x what the cluster serves)"
    )
    print_table(
        ["run", "max_wait_s", "aging/s", "longest's wait (ms)", "shorts' TTFT p90 (ms)"],
        [
            [k, v["max_wait_s"], v["aging_per_s"], v["longest_wait_ms"], v["short_ttft_p90_ms"]]
            for k, v in out.items()
        ],
    )
    return out


def heavy_tailed_jobs(rng: random.Random, n: int, rate: float) -> list[Job]:
    """Three kinds of request, one per tenant, each ending by EOS at its own length, all with
    the same max_tokens: a long text and a one-word answer (the longest prompts, the
    shortest outputs), a one-sentence summary, and an essay (short prompt, long output, up
    to the cap): a heavy tail that prompt length does not predict and the tenant does."""
    kinds = {
        "classify": FILLER * 4 + "Answer with one word only: is the text above about {t}?",
        "summary": "Summarize {t} in one short sentence.",
        "essay": STYLES[4],
    }
    jobs = []
    for t in poisson(rng, rate, n):
        tenant = rng.choices(list(kinds), weights=(5, 4, 2))[0]
        prompt = kinds[tenant].format(t=rng.choice(TOPICS))
        jobs.append(Job(t, tenant, prompt, 320, ignore_eos=False, kind=tenant))
    return jobs


def predictor_on_workloads(tokenizer) -> dict:
    """The output-length predictor replayed over the project's workloads
    (benchmarks/workloads/*.jsonl: ignore_eos, so each output is its max_tokens), each
    request predicted and then observed in turn, its kind as its tenant: once with
    max_tokens as given, once with it hidden (every request asking for 1,024), which leaves
    the tenant and the prompt's length to predict from. No cluster: nothing is timed."""
    from router.admission.predictor import LengthPredictor

    out = {}
    for path in sorted((ROOT / "benchmarks" / "workloads").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("ignore_eos") and "prompt" in r]
        for hidden in (False, True):
            p, errors = LengthPredictor(), []
            for r in rows:
                tenant, n = r.get("kind", "default"), len(tokenizer.encode_chat(r["prompt"]))
                cap = 1024 if hidden else r["max_tokens"]
                guess = p.predict(tenant, n, cap)
                errors.append(abs(guess - r["max_tokens"]))
                p.observe(tenant, n, cap, guess, r["max_tokens"])
            tail = errors[len(errors) // 4 :]  # past the first quarter: once it has learned
            mean = statistics.fmean(r["max_tokens"] for r in rows)
            out[f"{path.stem}{'_max_tokens_hidden' if hidden else ''}"] = {
                "requests": len(rows),
                "mean_output_tokens": round(mean, 1),
                "mae_tokens": round(statistics.fmean(errors), 1),
                "mae_tokens_after_first_quarter": round(statistics.fmean(tail), 1),
            }
    return out


def completion_summary(outs) -> dict:
    done = [o.job.at + o.e2e_s for o in outs if o.status == "OK" and o.e2e_s is not None]
    comp = [o.e2e_s for o in outs if o.status == "OK" and o.e2e_s is not None]
    span = max(done) if done else float("nan")
    return {
        "completed": len(comp),
        "mean_completion_ms": ms(statistics.fmean(comp)) if comp else None,
        "p99_completion_ms": ms(percentile(comp, 99)),
        "requests_per_s": round(len(comp) / span, 3) if comp else 0.0,
    }


async def capacity(c, what: str, burst: list[Job]) -> float:
    """Requests a second the cluster serves of `burst`'s mix, saturated: all sent at once,
    under the router's order as set; the faster of two bursts (a fresh cluster's first one
    also sets up its batch shapes, and has come out at half the second's rate). The
    scenarios that need a queue send past it, whatever the machine's speed."""
    rates = []
    for i in range(2):
        log(f"[{what}] capacity {i + 1}/2: {len(burst)} requests at once")
        outs = await run_jobs(c.address, [replace(j, at=0.0) for j in burst])
        rates.append(completion_summary(outs)["requests_per_s"])
    log(f"[{what}] capacity: {rates[0]} and {rates[1]} requests/s")
    return max(rates)


async def sjf(c, scale: float, tokenizer) -> dict:
    set_router(c, admission_policy="fcfs", admission_fair_share=False)
    cap = await capacity(c, "sjf", heavy_tailed_jobs(random.Random(7), 24, rate=1.0))
    rng = random.Random(4)
    jobs = heavy_tailed_jobs(rng, max(16, int(48 * scale)), rate=1.3 * cap)  # past capacity
    prompt_tokens = {j.prompt: len(tokenizer.encode_chat(j.prompt)) for j in jobs}
    out, truth = {}, {}
    set_router(c, admission_fair_share=False, admission_max_wait_s=None)
    runs = [("fcfs", "fcfs"), ("sjf_prompt", "priority"), ("sjf_predicted", "sjf"),
            ("sjf_oracle", "priority")]  # fmt: skip
    predictor = c.router.admission.predictor
    for name, policy in runs:
        set_router(c, admission_policy=policy)
        if name == "sjf_prompt":  # priority: lower first; the prompt's length alone
            run = [replace(j, priority=prompt_tokens[j.prompt]) for j in jobs]
        elif name == "sjf_oracle":  # the true cost, as sjf counts it
            run = [replace(j, priority=prompt_tokens[j.prompt] + 2 * truth[j.prompt]) for j in jobs]
        else:
            run = jobs
        log(f"[sjf] {name}: {len(run)} requests, heavy-tailed outputs")
        before = predictor.observed
        outs = await run_jobs(c.address, run)
        if name == "fcfs":
            truth = {o.job.prompt: o.tokens for o in outs if o.status == "OK"}
        out[name] = completion_summary(outs)
        if name == "sjf_predicted":
            out[name]["predictor_observed"] = predictor.observed - before
    lengths = sorted(truth.values())
    out["output_tokens"] = {
        "p50": percentile(lengths, 50),
        "p90": percentile(lengths, 90),
        "max": lengths[-1],
    }
    out["predictor_mae_tokens"] = round(predictor.mean_abs_error or float("nan"), 1)
    out["capacity_per_s"], out["rate_per_s"] = cap, round(1.3 * cap, 3)
    print("\nSJF: completion time (arrival to last token), heavy-tailed outputs")
    print_table(
        ["run", "completed", "mean (ms)", "p99 (ms)"],
        [
            [k, v["completed"], v["mean_completion_ms"], v["p99_completion_ms"]]
            for k, v in out.items()
            if isinstance(v, dict) and "completed" in v
        ],  # fmt: skip
    )
    lengths = out["output_tokens"]
    print(
        f"output-length predictor: mean absolute error {out['predictor_mae_tokens']} tokens "
        f"(outputs p50 {lengths['p50']}, p90 {lengths['p90']})"
    )
    return out


def slo_jobs(rng: random.Random, times: list[float]) -> list[Job]:
    """Interactive chats (TTFT 2 s) and batch requests (longer, TTFT 15 s), 3 to 2."""
    jobs = []
    for t in times:
        if rng.random() < 0.6:
            jobs.append(Job(t, "chat", chat(rng), 48, ttft_slo_ms=2000, tpot_slo_ms=250,
                            kind="interactive"))  # fmt: skip
        else:
            jobs.append(Job(t, "batch", long_prompt(rng, 4), 96, ttft_slo_ms=15000,
                            tpot_slo_ms=500, kind="batch"))  # fmt: skip
    return jobs


async def slo(c, scale: float) -> dict:
    """At 1x and 1.5x the rate the cluster serves this mix when saturated (measured first,
    under FCFS, all requests sent at once): where FCFS starts to miss the SLOs."""
    set_router(c, admission_policy="fcfs", admission_fair_share=False)
    cap = await capacity(c, "slo", slo_jobs(random.Random(6), [0.0] * max(12, int(24 * scale))))
    out: dict = {"capacity_per_s": cap}
    for factor in (1.0, 1.5):
        rate = cap * factor
        rng = random.Random(5)
        jobs = slo_jobs(rng, poisson(rng, rate, max(16, int(40 * scale))))
        span = jobs[-1].at
        for name in ("fcfs", "slack"):
            set_router(c, admission_policy=name, admission_fair_share=False)
            run = [replace(j, reject_if_late=name == "slack") for j in jobs]
            log(f"[slo] {name} at {rate:.2f}/s ({factor}x)")
            outs = await run_jobs(c.address, run)
            good = [o for o in outs if o.meets()]
            end = max((o.job.at + o.e2e_s for o in outs if o.e2e_s is not None), default=span)
            out[f"{name}_{factor}x"] = {
                "rate": round(rate, 3),
                "requests": len(outs),
                "good": len(good),
                "refused": sum(1 for o in outs if o.status == "RESOURCE_EXHAUSTED"),
                "goodput": round(len(good) / end, 3),
                "interactive_good": sum(1 for o in good if o.job.kind == "interactive"),
            }
    print(
        "\nSLO-aware: goodput (requests a second meeting both SLOs); saturated, the cluster "
        f"served {cap} requests a second"
    )
    runs = {k: v for k, v in out.items() if isinstance(v, dict)}
    print_table(
        ["run", "rate/s", "requests", "good", "refused early", "goodput/s"],
        [
            [k, v["rate"], v["requests"], v["good"], v["refused"], v["goodput"]]
            for k, v in runs.items()
        ],
    )
    return out


# -- plot ------------------------------------------------------------------------------------
def pairs(ax, labels: list[str], a: list[float], a_name: str, b: list[float], b_name: str):
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], a, 0.4, label=a_name)
    ax.bar([i + 0.2 for i in x], b, 0.4, label=b_name)
    ax.set_xticks(list(x), labels)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    panels = [k for k in ("noisy_neighbour", "weights", "sjf", "slo") if k in results]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else axes
    for ax, key in zip(axes, panels):
        r = results[key]
        if key == "noisy_neighbour":
            runs = list(r["runs"])
            x = range(len(runs))
            ax.bar(
                [i - 0.2 for i in x], [r[k]["b_ttft_p90_ms"] for k in runs], 0.4, label="TTFT p90"
            )
            ax.bar(
                [i + 0.2 for i in x], [r[k]["b_tpot_p90_ms"] for k in runs], 0.4, label="TPOT p90"
            )
            ax.set_xticks(list(x), runs)
            ax.set_yscale("log")
            ax.set_title("tenant B's latency (ms)")
            ax.legend()
        elif key == "weights":
            names = list(r["weights"])
            total = sum(r["tokens"].values()) or 1
            wsum = sum(r["weights"].values())
            x = range(len(names))
            ax.bar([i - 0.2 for i in x], [r["tokens"][t] / total for t in names], 0.4, label="got")
            ax.bar(
                [i + 0.2 for i in x], [r["weights"][t] / wsum for t in names], 0.4, label="weight"
            )
            ax.set_xticks(list(x), names)
            ax.set_title("share of output tokens")
            ax.legend()
        elif key == "sjf":
            runs = [k for k, v in r.items() if isinstance(v, dict) and "completed" in v]
            ax.bar(runs, [r[k]["mean_completion_ms"] or 0 for k in runs])
            ax.set_title("mean completion time (ms)")
            ax.tick_params(axis="x", rotation=20)
        else:
            runs = [k for k, v in r.items() if isinstance(v, dict)]
            ax.bar(runs, [r[k]["goodput"] for k in runs])
            ax.set_title("goodput (req/s meeting SLOs)")
            ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log(f"wrote {path}")


# -- main ------------------------------------------------------------------------------------
async def amain(args) -> dict:
    from workers.model.loader import resolve_model
    from workers.model.tokenizer import Tokenizer

    chosen = args.scenarios.split(",")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise SystemExit(
            f"unknown scenario(s) {', '.join(sorted(unknown))}: {', '.join(SCENARIOS)}"
        )
    results: dict = {"scale": args.scale}
    t0 = time.perf_counter()
    if "noisy" in chosen:
        results["noisy_neighbour"] = await noisy(args.scale, args.repeats)
    if "weights" in chosen:
        results["weights"] = await weights(args.scale)
    if {"starvation", "sjf", "slo"} & set(chosen):
        async with cluster("router-order", fair=False, seats=8, slots=2) as c:
            if "starvation" in chosen:
                results["starvation"] = await starvation(c, args.scale)
            if "sjf" in chosen:
                tokenizer = Tokenizer(resolve_model(None))
                results["sjf"] = await sjf(c, args.scale, tokenizer)
                results["sjf"]["predictor_on_workloads"] = predictor_on_workloads(tokenizer)
                print("\noutput-length predictor over the project's workloads (tokens)")
                print_table(
                    ["workload", "requests", "mean output", "MAE", "MAE after 1/4"],
                    [[k, v["requests"], v["mean_output_tokens"], v["mae_tokens"],
                      v["mae_tokens_after_first_quarter"]]
                     for k, v in results["sjf"]["predictor_on_workloads"].items()],
                )  # fmt: skip
            if "slo" in chosen:
                results["slo"] = await slo(c, args.scale)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--scale", type=float, default=1.0, help="workload size and duration")
    ap.add_argument(
        "--repeats", type=int, default=3, help="noisy: runs of each, the median reported"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "fairness.json")
    args = ap.parse_args(argv)
    try:
        results = asyncio.run(amain(args))
    finally:
        if _clients is not None:
            _clients.shutdown(cancel_futures=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    log(f"wrote {args.out} ({results['seconds']:.0f} s)")
    plot(results, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
