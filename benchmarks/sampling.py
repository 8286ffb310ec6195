"""What sampling costs: the sampler alone, and a whole decode step, against greedy.

    python benchmarks/sampling.py [--batches 1,16,64] [--iters 20] [--runs 3] [--steps 24]

1. The sampler on [batch, 49152] float32 logits (SmolLM2's vocabulary, Zipf-shaped), side
   by side in one run: Tandem's sampler (one uniform per row, inverse CDF in float64;
   top-k/top-p on each row's best candidates) against the design it replaced, rebuilt here:
   Gumbel-max with a hashed uniform per vocabulary entry and a sort of the whole vocabulary
   for top-k/top-p. Each cell is the median of --iters calls, then the median over --runs
   runs (the two designs alternate within each run).
2. The engine's decode step on the default model (fp32), batch 16, for each of the same
   modes and for min-p, the three penalties together, logit bias with min_tokens, and
   top_logprobs: the median step time over --steps decode steps.
3. Parallel sampling on the default model: one request with n = 8 against 8 lone requests
   seeded as its choices are, on a --n-prompt-token prompt: the most KV blocks held at once
   and the wall time, with the prefix cache cold (the lone requests arrive together) and
   warm (the prompt's full blocks already cached); the outputs are checked equal.
4. The same through a one-prefill, one-decode cluster (Ray, Redis, gRPC; fp32): the n = 8
   request against 8 lone requests sent together, alternating, --runs times: the KV pushes
   made, the most blocks the decode worker held (sampled every 20 ms from status), and the
   wall time; the outputs are checked equal.
`--parts` picks among sampler, step, parallel and cluster. Prints the tables; writes
benchmarks/results/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import RESULTS, log, print_table  # noqa: E402
from workers.engine.sampler import (  # noqa: E402
    _MASK32,
    FilterPlan,
    SamplingTensors,
    row_uniforms,
    sample,
)

VOCAB = 49152
MODES = {"greedy": (0.0, 0, 1.0), "temperature 1": (1.0, 0, 1.0), "top_k 50": (1.0, 50, 1.0)}
MODES["top_p 0.9"] = (1.0, 0, 0.9)
# The decode-step table: those modes, then the parameters that build more per step.
STEP_MODES = {
    mode: dict(temperature=temp, top_k=k, top_p=p) for mode, (temp, k, p) in MODES.items()
}
STEP_MODES["min_p 0.05"] = dict(min_p=0.05)
STEP_MODES["penalties"] = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
STEP_MODES["logit_bias + min_tokens"] = dict(logit_bias={2: -5.0, 198: 2.0}, min_tokens=20)
STEP_MODES["top_logprobs 5"] = dict(logprobs=True, top_logprobs=5)


SEED, COUNTER = 1234, 7  # row i draws with seed SEED + i at output index COUNTER


def tensors(n: int, temperature: float, top_k: int, top_p: float) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p),
        uniforms=torch.from_numpy(row_uniforms(range(SEED, SEED + n), [COUNTER] * n)),
        all_greedy=temperature == 0,
        filters=FilterPlan.of([top_k] * n, [top_p] * n, VOCAB),
        want_logprobs=False,
    )


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int64 tensors, as the replaced design hashed on the device."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def previous_sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The replaced design: a hashed uniform per vocabulary entry (exact, on the 2**23
    grid), Gumbel-max, and a sort of the whole vocabulary for top-k/top-p."""
    if t.all_greedy:
        return logits.argmax(dim=-1)
    scaled = logits / t.temperature[:, None]
    if t.filters is not None:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1])
        k = torch.where(t.top_k > 0, t.top_k, torch.full_like(t.top_k, scaled.shape[-1]))
        drop = ranks[None, :] >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= t.top_p[:, None]
        drop[:, 0] = False
        scaled = torch.empty_like(scaled).scatter_(
            -1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    vocab_ids = torch.arange(scaled.shape[-1], dtype=torch.int64)
    seeds = torch.arange(SEED, SEED + len(logits), dtype=torch.long)
    s = _fmix32((seeds & _MASK32) ^ _fmix32((seeds >> 32) & _MASK32))
    row = _fmix32(s ^ _fmix32((torch.full_like(seeds, COUNTER) * 0x9E3779B1) & _MASK32))
    x = _fmix32((row[:, None] + vocab_ids[None, :] * 0x27D4EB2F) & _MASK32)
    u = ((_fmix32(x ^ (row[:, None] >> 7)) >> 9).float() + 0.5) * (1.0 / 8388608.0)
    return (scaled.softmax(dim=-1) / -torch.log(u)).argmax(dim=-1)


def median_ms(fn, logits: torch.Tensor, t: SamplingTensors, iters: int) -> float:
    fn(logits, t)  # warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(logits, t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def sampler_table(batches: list[int], iters: int, runs: int) -> list[dict]:
    by_cell: dict[tuple, list[dict]] = {}
    for run in range(runs):
        for r in sampler_run(batches, iters):
            by_cell.setdefault((r["batch"], r["mode"]), []).append(r)
        log(f"sampler run {run + 1}/{runs} done")
    return [
        {
            "batch": n,
            "mode": mode,
            "tandem_ms": statistics.median(r["tandem_ms"] for r in rs),
            "previous_ms": statistics.median(r["previous_ms"] for r in rs),
            "runs": rs,
        }
        for (n, mode), rs in by_cell.items()
    ]


def sampler_run(batches: list[int], iters: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in batches:
        # A language model's shape: Zipf probabilities (p ~ rank**-1.5), ranks shuffled per
        # row; the 0.9 nucleus holds about 60 tokens.
        zipf = -1.5 * torch.arange(1, VOCAB + 1, dtype=torch.float32).log()
        perm = torch.stack([torch.randperm(VOCAB, generator=gen) for _ in range(n)])
        logits = zipf[perm]
        for mode, (temp, k, p) in MODES.items():
            t = tensors(n, temp, k, p)
            now = median_ms(sample, logits, t, iters)
            before = median_ms(previous_sample, logits, t, iters)
            rows.append({"batch": n, "mode": mode, "tandem_ms": now, "previous_ms": before})
    return rows


def step_table(steps: int, batch: int = 16) -> list[dict]:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=batch))
    prompt = list(range(100, 132))
    rows = []
    for mode, kw in STEP_MODES.items():
        sp = SamplingParams(max_tokens=steps + 4, seed=1, ignore_eos=True, **kw)
        for i in range(batch):
            engine.add_request(prompt, sp, f"{mode}-{i}")
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        decode = sorted(times[2:])  # past the prefill steps
        rows.append({"mode": mode, "batch": batch, "step_ms": statistics.median(decode) * 1000})
        log(f"decode step, batch {batch}, {mode}: {rows[-1]['step_ms']:.1f} ms")
    return rows


def parallel_table(n: int, prompt_tokens: int, max_tokens: int, runs: int) -> list[dict]:
    """Each cell: the most blocks held (the same every run) and the median wall time of
    `runs` runs, the four cells alternating within a run."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for run in range(runs):
        for r in parallel_run(n, prompt_tokens, max_tokens):
            cells.setdefault((r["cache"], r["mode"]), []).append(r)
        log(f"parallel sampling run {run + 1}/{runs} done")
    return [
        {
            "cache": cache,
            "mode": mode,
            "peak_blocks": rs[0]["peak_blocks"],
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "runs": rs,
        }
        for (cache, mode), rs in cells.items()
    ]


def parallel_run(n: int, prompt_tokens: int, max_tokens: int) -> list[dict]:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams, choice_seed

    prompt = [100 + (i * 37) % 20000 for i in range(prompt_tokens)]
    base = dict(max_tokens=max_tokens, temperature=1.0, top_p=0.95, ignore_eos=True)
    forked = [SamplingParams(n=n, seed=5, **base)]
    lone = [SamplingParams(seed=choice_seed(5, i), **base) for i in range(n)]
    rows, outputs = [], {}
    for cache in ("cold", "warm"):
        for label, params in ((f"n={n}", forked), (f"{n} lone requests", lone)):
            engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=1024))
            if cache == "warm":  # the prompt's full blocks in the prefix cache
                engine.add_request(prompt, SamplingParams(max_tokens=1))
                while engine.has_unfinished():
                    engine.step()
            ids = [engine.add_request(prompt, sp) for sp in params]
            tokens: dict[tuple[str, int], list[int]] = {}
            peak, t0 = 0, time.perf_counter()
            while engine.has_unfinished():
                for o in engine.step():
                    tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
                peak = max(peak, engine.pool.num_blocks - engine.pool.num_free_blocks)
            wall = time.perf_counter() - t0
            keys = [(ids[0], i) for i in range(n)] if len(ids) == 1 else [(r, 0) for r in ids]
            outputs[cache, label] = [tokens[k] for k in keys]
            rows.append({"cache": cache, "mode": label, "peak_blocks": peak, "wall_s": wall})
            log(f"parallel sampling, {cache} cache, {label}: {peak} blocks, {wall:.1f} s")
        assert outputs[cache, f"n={n}"] == outputs[cache, f"{n} lone requests"], (
            "choices differ from their lone requests"
        )
    return rows


def cluster_table(n: int, prompt_tokens: int, max_tokens: int, runs: int) -> list[dict]:
    import asyncio
    import tempfile

    from client import TandemClient, status_to_dict
    from cluster import config_io
    from cluster.cluster import Cluster
    from cluster.config import ClusterConfig
    from router.api import tandem_pb2 as pb
    from workers.engine.request import choice_id, choice_seed
    from workers.messages import Pool

    prompt = [100 + (i * 37) % 20000 for i in range(prompt_tokens)]

    def msg(rid: str, seed: int, choices: int) -> pb.GenerateRequest:
        base = dict(max_tokens=max_tokens, temperature=1.0, top_p=0.95, ignore_eos=True)
        sp = pb.SamplingParams(**base, seed=seed, n=choices)
        return pb.GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sp)

    async def measure(c: Cluster, client: TandemClient, label: str, run: int) -> dict:
        if label.startswith("n="):
            msgs, ids = [msg(f"n{run}", 5, n)], [choice_id(f"n{run}", i) for i in range(n)]
        else:
            ids = [f"lone{run}-{i}" for i in range(n)]
            msgs = [msg(rid, choice_seed(5, i), 1) for i, rid in enumerate(ids)]
        peak = {"decode": 0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                s = status_to_dict(await client.status())
                for pool in peak:
                    for w in s[pool]:
                        used = w["kv_blocks_total"] - w["kv_blocks_free"]
                        peak[pool] = max(peak[pool], used)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client.generate_choices(m) for m in msgs))
        wall = time.perf_counter() - t0
        done.set()
        await watcher
        tokens = [r.token_ids for rs in results for r in rs]
        assert all(r.status == "OK" for rs in results for r in rs)
        prefill = c.router.fleet.directory.members(Pool.PREFILL)[0]
        pushed = [await prefill.handle.push_result.remote(rid, 5.0) for rid in ids]
        log(f"cluster, {label}, run {run + 1}: {peak}, {wall:.1f} s")
        return {
            "mode": label,
            "kv_pushes": sum(p.ok for p in pushed),
            "peak_decode_blocks": peak["decode"],
            "wall_s": wall,
            "tokens": tokens,
        }

    async def go() -> list[dict]:
        values = dict(
            router={"port": 0},
            dashboard=False,
            engine={"num_kv_blocks": 1024, "dtype": "float32"},
            data_dir=tempfile.mkdtemp(prefix="tandem-bench-"),
        )
        c = Cluster(config_io.build(ClusterConfig, values, "benchmark"))
        await c.start(progress=log)
        client = TandemClient(c.address)
        rows = []
        try:
            for run in range(runs):
                for label in (f"n={n}", f"{n} lone requests"):
                    rows.append(await measure(c, client, label, run))
                assert rows[-1]["tokens"] == rows[-2]["tokens"], "choices differ from lone requests"
        finally:
            await client.close()
            await c.stop()
        return rows

    rows = asyncio.run(go())
    table = []
    for label in (f"n={n}", f"{n} lone requests"):
        rs = [r for r in rows if r["mode"] == label]
        for r in rs:
            del r["tokens"]
        table.append(
            {
                "mode": label,
                "kv_pushes": rs[0]["kv_pushes"],
                "peak_decode_blocks": statistics.median(r["peak_decode_blocks"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "runs": rs,
            }
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="sampler,step,parallel,cluster")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--n-prompt-tokens", type=int, default=500)
    ap.add_argument("--n-max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    samplers = steps = parallel = clustered = []
    if "sampler" in parts:
        samplers = sampler_table([int(b) for b in args.batches.split(",")], args.iters, args.runs)
    if "step" in parts:
        steps = step_table(args.steps)
    if "parallel" in parts:
        parallel = parallel_table(args.n, args.n_prompt_tokens, args.n_max_tokens, args.runs)
    if "cluster" in parts:
        clustered = cluster_table(args.n, args.n_prompt_tokens, args.n_max_tokens, args.runs)
    if samplers:
        print(f"\nThe sampler alone, [batch, 49152] logits, ms per call (median of {args.runs}):")
        print_table(
            ["batch", "mode", "Tandem ms", "previous design ms", "previous / Tandem"],
            [
                [
                    r["batch"],
                    r["mode"],
                    f"{r['tandem_ms']:.2f}",
                    f"{r['previous_ms']:.2f}",
                    f"{r['previous_ms'] / r['tandem_ms']:.1f}x",
                ]
                for r in samplers
            ],
        )
    if steps:
        greedy = next(r["step_ms"] for r in steps if r["mode"] == "greedy")
        print("\nThe engine's decode step, SmolLM2 fp32, batch 16, median ms:")
        print_table(
            ["mode", "step ms", "vs greedy"],
            [[r["mode"], f"{r['step_ms']:.1f}", f"{r['step_ms'] / greedy:.2f}x"] for r in steps],
        )
    if parallel:
        print(
            f"\nParallel sampling, {args.n_prompt_tokens}-token prompt, {args.n_max_tokens} "
            f"tokens per choice, 16-token blocks, median wall of {args.runs} (outputs equal):"
        )
        print_table(
            ["prefix cache", "mode", "most KV blocks held", "wall s"],
            [[r["cache"], r["mode"], r["peak_blocks"], f"{r['wall_s']:.1f}"] for r in parallel],
        )
    if clustered:
        print(
            f"\nParallel sampling through a 1P1D cluster, {args.n_prompt_tokens}-token prompt, "
            f"{args.n_max_tokens} tokens per choice, median of {args.runs} (outputs equal):"
        )
        print_table(
            ["mode", "KV pushes", "peak decode blocks", "wall s"],
            [
                [
                    r["mode"],
                    r["kv_pushes"],
                    f"{r['peak_decode_blocks']:.0f}",
                    f"{r['wall_s']:.1f}",
                ]
                for r in clustered
            ],
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "sampling.json"
    report = {"args": vars(args), "sampler": samplers, "step": steps, "parallel": parallel}
    report["cluster"] = clustered
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
