"""Online serving: one arrival trace replayed against several systems, in the same run.

    python benchmarks/serving.py [--rate 1.0] [--burstiness 1.0] [--slo-ttft-ms 2000]
        [--slo-tpot-ms 200] [--systems tandem-disagg,tandem-colocated,...] [--runs 1]

Requests come from a JSONL workload (default: short chats with long documents mixed in) at
Poisson arrivals (--burstiness 1) or gamma arrivals (other values), seeded, so every system
sees the same trace. Systems:
- tandem-disagg: 1 prefill + 1 decode worker, one core each (the prefill worker runs
  --prefill-threads threads, default 1), prompts of up to --local-prefill-max-tokens (128)
  prefilled on the decode worker;
- tandem-colocated: 1 worker doing both phases on both cores, chunked prefill, the chunks
  paced so that the running sequences keep --target-tpot-ms (engine.target_tpot_ms; the
  decode worker's local prefills are paced alike);
- tandem-colocated-unchunked: the same without chunking (a long prompt stalls decodes);
- vllm: vLLM's CPU build behind its OpenAI-compatible server, when installed (see README),
  driven through the streaming /v1/completions API with the same token ids;
- tandem-disagg-http (not in the default list): tandem-disagg driven through its own
  OpenAI-compatible front by the same client as vllm, to compare the two on one endpoint.
All load the same weights (the default model exported once as an HF folder), in bf16.

Metrics follow `vllm bench serve`: TTFT; TPOT = (E2E - TTFT) / (output tokens - 1); ITL =
the gaps between successive streamed chunks; E2E; request and output-token throughput over
the run; goodput = requests per second meeting both the TTFT and the TPOT SLO.
Writes JSON and PNGs (latency CDFs; ITL over time with long-prompt arrivals marked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    RESULTS,
    ROOT,
    export_default_model,
    log,
    percentile,
    print_table,
    vllm_env,
)
from workers.engine.config import POLICIES  # noqa: E402

SYSTEMS = ["tandem-disagg", "tandem-colocated", "tandem-colocated-unchunked", "vllm"]
HTTP_SUFFIX = "-http"  # a Tandem system driven over its OpenAI-compatible front


def load_trace(
    path: Path, model_dir: Path, rate: float, burstiness: float, seed: int, limit: int | None
) -> list[dict]:
    from workers.model.loader import ModelSource
    from workers.model.tokenizer import Tokenizer

    tok = Tokenizer(ModelSource(model_dir))
    rng = random.Random(seed)
    t, trace = 0.0, []
    for line in path.read_text().splitlines()[:limit]:
        r = json.loads(line)
        ids = r.get("prompt_ids") or tok.encode_chat(r["prompt"])
        # Gamma with shape k and mean 1/rate: k=1 is Poisson; smaller k is burstier.
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        trace.append(
            {
                "at": t,
                "prompt_ids": ids,
                "max_tokens": r.get("max_tokens", 16),
                "kind": r.get("kind", "chat"),
            }
        )
    return trace


# -- clients: each returns per-request records {ok, ttft, e2e, chunks: [(t, n_tokens)]} --------
def trace_request(r: dict, request_id: str = ""):
    """A trace row as a Generate call: greedy, EOS ignored (every system makes max_tokens)."""
    from router.api import tandem_pb2 as pb

    sampling = pb.SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, prompt_ids=r["prompt_ids"], sampling=sampling)


async def run_grpc(address: str, trace: list[dict], t0: float) -> list[dict]:
    from client import TandemClient

    client = TandemClient(address)

    async def one(r):
        await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
        start = time.perf_counter()
        chunks = []
        res = await client.generate(
            trace_request(r),
            timeout_s=600,
            on_chunk=lambda m: (
                chunks.append((time.perf_counter(), len(m.token_ids))) if m.token_ids else None
            ),
        )
        return record(r, start, chunks, res.status == "OK", res.error)

    try:
        return await asyncio.gather(*(one(r) for r in trace))
    finally:
        await client.close()


async def run_openai(base_url: str, model: str, trace: list[dict], t0: float) -> list[dict]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(r):
            await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
            start = time.perf_counter()
            chunks, ok, error = [], True, None
            body = {
                "model": model,
                "prompt": r["prompt_ids"],
                "max_tokens": r["max_tokens"],
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            counted = None  # the usage event's completion_tokens: events may hold several
            try:
                async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        return record(r, start, [], False, f"HTTP {resp.status}")
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if data.get("choices") and data["choices"][0].get("text"):
                            chunks.append((time.perf_counter(), 1))
                        if data.get("usage"):
                            counted = data["usage"]["completion_tokens"]
            except Exception as e:
                ok, error = False, f"{type(e).__name__}: {e}"
            if counted is not None and chunks:  # ITL stays per event, as vllm bench serve
                chunks[-1] = (chunks[-1][0], counted - (len(chunks) - 1))
            return record(r, start, chunks, ok, error)

        return await asyncio.gather(*(one(r) for r in trace))


def record(r: dict, start: float, chunks: list, ok: bool, error) -> dict:
    times = [t for t, _ in chunks]
    n = sum(k for _, k in chunks)
    return {
        "ok": ok and bool(chunks),
        "error": error,
        "kind": r["kind"],
        "arrival": r["at"],
        "start": start,
        "ttft": times[0] - start if times else None,
        "e2e": times[-1] - start if times else None,
        "output_tokens": n,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "chunk_times": times,
    }


def summarize(records: list[dict], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    itl = [x for r in ok for x in r["itl"]]
    good = sum(
        1
        for r in ok
        if r["ttft"] <= slo_ttft
        and (
            r["output_tokens"] <= 1 or (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) <= slo_tpot
        )
    )
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r["output_tokens"] for r in ok) / duration,
        "goodput": good / duration,
        "good_requests": good,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        xs = sorted(xs)
        for p in (50, 90, 99, 99.9):
            out[f"{name}_p{p}_ms"] = 1000 * percentile(xs, p)
        out[f"{name}_max_ms"] = 1000 * xs[-1] if xs else float("nan")
        out[f"{name}_mean_ms"] = 1000 * statistics.fmean(xs) if xs else float("nan")
    return out


# -- systems ---------------------------------------------------------------------------------
async def run_tandem(
    system: str,
    model_dir: Path,
    trace: list[dict],
    data_dir: Path,
    prefill_threads: int,
    dtype: str = "bfloat16",
    policy: str = "shortest-first",
    local_prefill_max_tokens: int = 0,
    target_tpot_ms: float | None = None,
) -> tuple:
    from cluster import config_io
    from cluster.cluster import Cluster
    from cluster.config import ClusterConfig

    engine = dict(
        model=str(model_dir),
        dtype=dtype,
        kv_cache_gb=1.0,
        max_num_seqs=64,
        policy=policy,
        target_tpot_ms=target_tpot_ms or None,
    )
    per_system = {
        "tandem-disagg": dict(
            mode="disaggregated",
            prefill=dict(replicas=1, cpus=1, threads=prefill_threads),
            decode=dict(replicas=1, cpus=1),
            engine=dict(engine, prefill_chunk_size=256, max_num_batched_tokens=512),
        ),
        # colocated: one worker with both cores; chunked, or a long prompt in one step
        "tandem-colocated": dict(
            mode="colocated",
            decode=dict(replicas=1, cpus=2),
            engine=dict(engine, prefill_chunk_size=256, max_num_batched_tokens=256),
        ),
        "tandem-colocated-unchunked": dict(
            mode="colocated",
            decode=dict(replicas=1, cpus=2),
            engine=dict(
                engine,
                enable_chunked_prefill=False,
                max_num_batched_tokens=4096,
                target_tpot_ms=None,  # pacing sizes chunks: nothing to pace unchunked
            ),
        ),
    }
    http = system.endswith(HTTP_SUFFIX)
    router = {"port": 0, "local_prefill_max_tokens": local_prefill_max_tokens}
    if http:
        router["http_port"] = 0
    base = per_system[system.removesuffix(HTTP_SUFFIX)]
    values = dict(base, router=router, dashboard=False, data_dir=str(data_dir))
    cfg = config_io.build(ClusterConfig, values, system)
    cluster = await Cluster(cfg).start(progress=lambda m: log(f"  {m}"))

    async def drive(rows: list[dict], t0: float) -> list[dict]:
        if http:  # the served model's name is the model path it was given
            url = f"http://127.0.0.1:{cluster.http_port}"
            return await run_openai(url, str(model_dir), rows, t0)
        return await run_grpc(cluster.address, rows, t0)

    try:
        await drive(trace[:2], time.perf_counter())  # warm-up
        t0 = time.perf_counter()
        records = await drive(trace, t0)
        return records, t0
    finally:
        await cluster.stop()


async def run_vllm(
    vllm_python: Path,
    model_dir: Path,
    trace: list[dict],
    dtype: str = "bfloat16",
    threads: int | None = 2,
) -> tuple:
    from cluster.redis_server import free_port

    port = free_port()
    cmd = [
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "64",
        "--kv-cache-memory-bytes",
        str(2**30),
        "--served-model-name",
        "smollm2",
    ]
    logf = open(RESULTS / "vllm_server.log", "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=vllm_env(threads))
    try:
        import aiohttp

        deadline = time.monotonic() + 600
        async with aiohttp.ClientSession() as s:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM server exited ({proc.returncode}); see {RESULTS / 'vllm_server.log'}"
                    )
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM server did not become healthy in 600 s")
                await asyncio.sleep(1)
        base = f"http://127.0.0.1:{port}"
        await run_openai(base, "smollm2", trace[:2], time.perf_counter())
        t0 = time.perf_counter()
        return await run_openai(base, "smollm2", trace, t0), t0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def plots(all_records: dict, trace: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2e")):
        for name, (records, _) in all_records.items():
            ok = [r for r in records if r["ok"]]
            if key == "itl":
                xs = [x for r in ok for x in r["itl"]]
            elif key == "tpot":
                xs = [
                    (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
                    for r in ok
                    if r["output_tokens"] > 1
                ]
            else:
                xs = [r[key] for r in ok]
            xs = sorted(1000 * x for x in xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("CDF")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "_cdf.png"), dpi=110)

    names = list(all_records)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(10, 2.2 * len(names)), sharex=True, squeeze=False
    )
    long_at = [r["at"] for r in trace if r["kind"] == "long"]
    for ax, name in zip(axes[:, 0], names):
        records, t0 = all_records[name]
        for r in records:
            ts = r["chunk_times"]
            ax.scatter([t - t0 for t in ts[1:]], [1000 * g for g in r["itl"]], s=2)
        for a in long_at:
            ax.axvline(a, color="red", alpha=0.3, linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("ITL ms")
        ax.set_title(f"{name} (red: long-prompt arrivals)", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the trace")
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "_itl.png"), dpi=110)


async def amain(args) -> None:
    model_dir = export_default_model(RESULTS / "smollm2-135m-instruct-hf")
    trace = load_trace(
        Path(args.workload), model_dir, args.rate, args.burstiness, args.seed, args.limit
    )
    n_long = sum(1 for r in trace if r["kind"] == "long")
    log(
        f"trace: {len(trace)} requests over {trace[-1]['at']:.0f} s ({n_long} long prompts), "
        f"rate {args.rate}/s, burstiness {args.burstiness}"
    )
    summaries, all_records = {}, {}
    for system in args.systems.split(","):
        runs = []
        for i in range(args.runs):
            log(f"[{system}] run {i + 1}/{args.runs}")
            try:
                if system == "vllm":
                    if not args.vllm_python.is_file():
                        summaries[system] = {"skipped": f"no vLLM at {args.vllm_python}"}
                        break
                    records, t0 = await run_vllm(
                        args.vllm_python, model_dir, trace, args.dtype, args.vllm_threads or None
                    )
                else:
                    records, t0 = await run_tandem(
                        system,
                        model_dir,
                        trace,
                        RESULTS / f"data-{system}",
                        args.prefill_threads,
                        args.dtype,
                        args.policy,
                        args.local_prefill_max_tokens,
                        args.target_tpot_ms,
                    )
            except Exception as e:
                log(f"[{system}] failed: {e}")
                summaries[system] = {"error": str(e)}
                break
            duration = max(r["start"] + (r["e2e"] or 0) for r in records) - t0
            runs.append(
                summarize(records, duration, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
            )
            all_records[system] = (records, t0)
        if runs:
            summaries[system] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            summaries[system]["runs"] = runs
    rows = []
    for name, s in summaries.items():
        if "completed" not in s:
            rows.append([name] + ["-"] * 11 + [s.get("skipped") or s.get("error", "")[:50]])
            continue
        rows.append(
            [
                name,
                f"{s['completed']}/{s['completed'] + s['failed']}",
                f"{s['goodput']:.2f}",
                f"{s['output_throughput']:.1f}",
                f"{s['ttft_p50_ms']:.0f}",
                f"{s['ttft_p99_ms']:.0f}",
                f"{s['tpot_p50_ms']:.0f}",
                f"{s['tpot_p99_ms']:.0f}",
                f"{s['itl_p50_ms']:.0f}",
                f"{s['itl_p99_ms']:.0f}",
                f"{s['itl_p99.9_ms']:.0f}",
                f"{s['itl_max_ms']:.0f}",
                "",
            ]
        )
    print(
        f"SLOs: TTFT <= {args.slo_ttft_ms} ms, TPOT <= {args.slo_tpot_ms} ms; median of "
        f"{args.runs} run(s)"
    )
    print_table(
        [
            "system",
            "done",
            "goodput r/s",
            "tok/s",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "ITL p50",
            "ITL p99",
            "ITL p99.9",
            "ITL max",
            "note",
        ],
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The last run's requests, times relative to its start: what the plots are drawn from.
    last = {
        name: [
            {**r, "start": r["start"] - t0, "chunk_times": [t - t0 for t in r["chunk_times"]]}
            for r in records
        ]
        for name, (records, t0) in all_records.items()
    }
    args.out.write_text(
        json.dumps(
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "summaries": summaries,
                "requests": last,
            },
            indent=2,
        )
    )
    if all_records:
        plots(all_records, trace, args.out)
    print(f"wrote {args.out} and its PNGs")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default=str(ROOT / "benchmarks/workloads/serving_default.jsonl"))
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="float32 on CPUs without native bf16 (no AVX512-BF16/AMX), where bf16 is slower",
    )
    p.add_argument(
        "--prefill-threads",
        type=int,
        default=1,
        help="torch threads of the disaggregated prefill worker (decode gets 1)",
    )
    p.add_argument(
        "--policy",
        default="shortest-first",
        choices=POLICIES,
        help="Tandem's scheduling order (shortest-first: a short prompt goes ahead of the "
        "chunks of long ones)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=128,
        help="disaggregated: requests this short are prefilled on their decode worker "
        "(router.local_prefill_max_tokens; 0: every prompt goes to the prefill worker)",
    )
    p.add_argument(
        "--target-tpot-ms",
        type=float,
        default=None,
        help="Tandem's engine.target_tpot_ms: prompt chunks paced so running sequences keep "
        "this time per token (default: 0.8 x the TPOT SLO, as the engine measures its own "
        "steps and a client also sees the stream's delivery; 0: off)",
    )
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--vllm-threads",
        type=int,
        default=2,
        help="cores vLLM's model worker is bound to (0: vLLM's default, all but one)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    args = p.parse_args()
    if args.target_tpot_ms is None:
        args.target_tpot_ms = 0.8 * args.slo_tpot_ms
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
