"""The KV handoff's cost: its bandwidth against raw torch.distributed send/recv of the same
bytes, and what it adds to a prefill once the prefill's compute is over.

    python benchmarks/kv_transfer.py [--part wire|prefill|both] [--dtype bfloat16]
        [--kv-cache-dtype auto|fp8]
        [--lengths 128,...] [--iters 20] [--wire-runs 3] [--prefill-lengths 1024] [--runs 5]

Part `wire`: two processes on loopback, each with one thread, joined by a gloo pair group
exactly as a prefill and a decode worker are (TCPStore rendezvous, PairGroup). For each prompt
length, the KV of SmolLM2-135M's layout is moved between two paged caches, same bytes each
time:
- raw: one contiguous tensor sent with the group's send/recv, then a 1-element ack back. Two
  ways: the same buffer every time (hot: it stays in this CPU's 32 MB L3 up to 1k tokens),
  and a buffer taken in turn from four (cold, as a cache's blocks are when they are sent).
  A third row sends the hot buffer as 30 messages, as many as the handoff's for blocks in one
  run (one per layer, K and V side by side): what gloo's per-message cost alone takes;
- handoff, blocks in runs: Tandem's protocol (header and runs, placement, the layers,
  trailer, ack) between blocks that are consecutive in both caches, as a fresh cache hands them out:
  every layer moves straight from cache to cache;
- handoff, churned cache: both sides' blocks allocated by the engine's BlockPool after a
  simulated serving history (prompts of random length, decodes growing one block at a time,
  requests ending in random order); segments that are not one run on a side are staged there;
- handoff, scattered: every block apart on both sides (a random permutation), so each layer
  is gathered into a staging buffer on the sender and scattered out of one on the receiver.
Median of --iters transfers per cell, then the median over --wire-runs runs, each in a fresh
pair of processes; bandwidth is bytes / that median.

Part `prefill`: real Ray actors, a prefill and a decode worker with the default model (one
thread each, as `tandem up` gives them), and fresh random prompts, one at a time. For each it
reports the prefill time (the `prefill` call, to its first token) and the handoff's tail: from
the first token sampled to the decode worker having admitted the request (PushResult.seconds).
Two prefill workers run side by side, alternating: one streams each layer's KV as the model
computes it (the default), one sends after the prefill's compute.

Writes JSON, and a PNG of part `wire`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import RESULTS, print_table  # noqa: E402
from kv_transfer.channel import PagedBlocks, StagingBuffers, recv_kv, send_kv  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.protocol import TransferDescriptor  # noqa: E402
from kv_transfer.torch_dist import PairGroup, store_client, store_server  # noqa: E402
from workers.engine.block_pool import BlockPool  # noqa: E402
from workers.engine.model_runner import allocate_kv_cache  # noqa: E402
from workers.model.cpu_kernels import cpu_kernels  # noqa: E402

CACHE_BLOCKS = 1024


def layout_for(dtype: str, kv_cache_dtype: str = "auto") -> KVLayout:
    """SmolLM2's KV layout, in `dtype`, or in fp8 with kv_cache_dtype fp8 (a byte a value)."""
    if kv_cache_dtype == "fp8":
        dtype = "float8_e4m3fn"
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)


def make_cache(layout: KVLayout):
    cache = allocate_kv_cache(layout, CACHE_BLOCKS, torch.device("cpu"))
    for layer in cache:
        layer.copy_(torch.randn(layer.shape).to(layer.dtype))  # fp8 takes no normal_()
    return cache


def churned_blocks(n_blocks: int, seed: int) -> list[int]:
    """`n_blocks` as the engine's BlockPool hands them out after a serving history: requests
    with prompts of 1-64 blocks arrive while others decode (each growing a block at a time,
    interleaved) and end in random order, until the pool has turned over several times."""
    rng = random.Random(seed)
    pool = BlockPool(CACHE_BLOCKS, 16)
    live: list[list[int]] = []
    allocated = 0
    while allocated < 8 * CACHE_BLOCKS:
        if live and (rng.random() < 0.3 or pool.num_free_blocks < CACHE_BLOCKS // 2):
            pool.free(live.pop(rng.randrange(len(live))))
            continue
        prompt = rng.randint(1, 64)
        if pool.can_allocate(prompt):
            live.append(pool.allocate(prompt))
            allocated += prompt
        for table in live:  # a decode step's growth, for some of them
            if rng.random() < 0.25 and pool.can_allocate(1):
                table += pool.allocate(1)
                allocated += 1
    while pool.num_free_blocks < n_blocks:
        pool.free(live.pop(rng.randrange(len(live))))
    return pool.allocate(n_blocks)


RAW = ("raw", "raw_cold", "raw_split")
CASES = ("runs", "churned", "scattered")


def wire_worker(rank: int, port_file: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    layout = layout_for(args["dtype"], args["kv_cache_dtype"])
    ops = cpu_kernels()  # the scatter kernel, as the decode worker has it
    if rank == 1:
        server = store_server("127.0.0.1")
        Path(port_file).write_text(str(server.port))
        store = server
    else:
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            time.sleep(0.05)
        store = store_client("127.0.0.1", int(Path(port_file).read_text()), 30)
    group = PairGroup(store, "bench/1", rank, torch.device("cpu"), "127.0.0.1", 60)
    cache = make_cache(layout)
    gen = torch.Generator().manual_seed(rank)
    results = []
    for length in args["lengths"]:
        n_blocks = -(-length // layout.block_size)
        nbytes = layout.bytes_per_block * n_blocks
        blocks = {
            "runs": list(range(100, 100 + n_blocks)),
            "churned": churned_blocks(n_blocks, seed=length * 2 + rank),
            "scattered": torch.randperm(CACHE_BLOCKS, generator=gen)[:n_blocks].tolist(),
        }
        raws = torch.randn(4, nbytes // layout.torch_dtype.itemsize).to(layout.torch_dtype)
        ack = torch.zeros(1, dtype=torch.int64)
        desc = TransferDescriptor(f"req-{length}", layout, n_blocks, length)
        staging = StagingBuffers()
        timings = {k: [] for k in (*RAW, *CASES)}
        plans = {}
        for i in range(args["iters"] + 1):  # the first round warms up
            messages = layout.num_layers  # as many as the handoff sends for one run
            for raw_case, raw in (
                ("raw", [raws[0]]),
                ("raw_cold", [raws[1 + i % 3]]),
                ("raw_split", list(raws[0].chunk(messages))),
            ):
                group.send([ack], 60) if rank == 0 else group.recv([ack], 60)  # line up
                t = time.perf_counter()
                if rank == 0:
                    group.send(raw, 60)
                    group.recv([ack], 60)
                else:
                    group.recv(raw, 60)
                    group.send([ack], 60)
                if i:
                    timings[raw_case].append(time.perf_counter() - t)
            for case in CASES:
                scatter = ops.scatter_blocks if ops is not None else None
                side = PagedBlocks(blocks[case], cache.__getitem__, scatter)
                group.send([ack], 60) if rank == 0 else group.recv([ack], 60)
                t = time.perf_counter()
                if rank == 0:
                    plans[case] = send_kv(group, desc, side, 60, staging=staging)
                else:
                    recv_kv(group, layout, 60, target=lambda d, s=side: s, staging=staging)
                if i:
                    timings[case].append(time.perf_counter() - t)
        results.append(
            {
                "prompt_tokens": length,
                "bytes": nbytes,
                **{k: statistics.median(v) for k, v in timings.items()},
                **(
                    {
                        f"{c}_plan": {
                            "segments": list(p.segments),
                            "staged_send_blocks": p.staged_send,
                            "staged_recv_blocks": p.staged_recv,
                        }
                        for c, p in plans.items()
                    }
                    if rank == 0
                    else {}
                ),
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    group.close()


def run_wire(args) -> list[dict]:
    job = {
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "lengths": [int(x) for x in args.lengths.split(",")],
        "iters": args.iters,
    }
    port_file = str(args.out.with_suffix(".port"))
    tmp = str(args.out.with_suffix(".tmp"))
    runs = []
    for run in range(args.wire_runs):  # each a fresh pair of processes
        Path(port_file).unlink(missing_ok=True)
        mp.spawn(wire_worker, args=(port_file, job, tmp), nprocs=2, join=True)
        runs.append(json.loads(Path(tmp).read_text()))
        Path(tmp).unlink()
        one = [f"{r['prompt_tokens']}: runs/raw {r['raw'] / r['runs']:.0%}" for r in runs[-1]]
        print(f"  run {run + 1}: " + ", ".join(one), flush=True)
    Path(port_file).unlink(missing_ok=True)
    rows = runs[0]
    for i, r in enumerate(rows):  # each time the median over the runs
        for k in (*RAW, *CASES):
            r[f"{k}_runs"] = [run[i][k] for run in runs]
            r[k] = statistics.median(r[f"{k}_runs"])
    table = []
    for r in rows:
        for k in (*RAW, *CASES):
            r[f"{k}_GBps"] = r["bytes"] / r[k] / 1e9
        for c in CASES:
            r[f"{c}_vs_raw"] = r[f"{c}_GBps"] / r["raw_GBps"]
            r[f"{c}_vs_raw_cold"] = r[f"{c}_GBps"] / r["raw_cold_GBps"]
        churned = r["churned_plan"]
        table.append(
            [
                r["prompt_tokens"],
                f"{r['bytes'] / 2**20:.1f}",
                *(f"{r[c] * 1e3:.2f}" for c in (*RAW, *CASES)),
                *(f"{r[f'{c}_vs_raw']:.0%} / {r[f'{c}_vs_raw_cold']:.0%}" for c in CASES),
                f"{len(churned['segments'])} / "
                f"{churned['staged_send_blocks']}+{churned['staged_recv_blocks']} "
                f"of {sum(churned['segments'])}",
            ]
        )
    print_table(
        [
            "prompt",
            "MiB",
            "raw ms (hot)",
            "raw ms (cold)",
            "raw ms (30 msgs)",
            "runs ms",
            "churned ms",
            "scattered ms",
            "runs / raw (hot / cold)",
            "churned / raw",
            "scattered / raw",
            "churned: segments / staged blocks",
        ],
        table,
    )
    plot(rows, args.out.with_suffix(".png"), args.dtype)
    return rows


def run_prefill(args) -> list[dict]:
    """The handoff's tail after real prefills, streamed and not, through the workers."""
    import ray

    from workers.decode import DecodeWorker
    from workers.engine.config import EngineConfig
    from workers.engine.request import SamplingParams
    from workers.messages import DecodeEndpoint, PrefillJob, RequestSpec
    from workers.prefill import PrefillWorker

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, namespace="tandem-bench")
    try:
        cfg = EngineConfig(
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=1,
            kv_cache_gb=0.5,
        )

        def start(cls, name, **kwargs):
            actor = (
                ray.remote(cls)
                .options(name=name, num_cpus=1, max_concurrency=16)
                .remote(name, cfg, transfer_host="127.0.0.1", **kwargs)
            )
            return actor, ray.get(actor.info.remote(), timeout=300)

        decode, dinfo = start(DecodeWorker, "bench-decode")
        endpoint = DecodeEndpoint("bench-decode", dinfo.endpoint.host, dinfo.endpoint.port, decode)
        senders = {
            "streamed": start(PrefillWorker, "bench-prefill-streamed")[0],
            "after prefill": start(PrefillWorker, "bench-prefill-after", stream_kv=False)[0],
        }
        rng = random.Random(0)
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, seed=1)
        samples = {(mode, n): [] for mode in senders for n in args.prefill_lengths}
        for run in range(args.runs + 1):  # the first round warms up
            for n in args.prefill_lengths:
                for mode, prefill in senders.items():
                    rid = f"r{run}-{n}-{mode.replace(' ', '-')}"
                    prompt = tuple(rng.randrange(1000, 40000) for _ in range(n))
                    assert ray.get(decode.reserve.remote(rid, 1, n, "bench", 120.0)) is not None
                    t0 = time.perf_counter()
                    job = PrefillJob(RequestSpec(rid, prompt, sp, router_id="bench"), endpoint)
                    first = ray.get(prefill.prefill.remote(job), timeout=300)
                    prefill_s = time.perf_counter() - t0
                    push = ray.get(prefill.push_result.remote(rid), timeout=300)
                    if not (first.ok and push.ok):
                        raise RuntimeError(f"{rid}: {first.error or push.error}")
                    deadline = time.monotonic() + 300
                    while not any(
                        e.request_id == rid and e.finished
                        for e in ray.get(decode.poll.remote("bench", 1.0))
                    ):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{rid}: the decode worker never finished it")
                    if run:
                        samples[mode, n].append((prefill_s, push.seconds))
                    ms = (prefill_s * 1e3, push.seconds * 1e3)
                    print(f"  {rid}: prefill {ms[0]:.0f} ms, tail {ms[1]:.1f} ms", flush=True)
    finally:
        ray.shutdown()
    rows, table = [], []
    for (mode, n), xs in samples.items():
        prefill_s = statistics.median(x[0] for x in xs)
        tail_s = statistics.median(x[1] for x in xs)
        rows.append(
            {
                "mode": mode,
                "prompt_tokens": n,
                "prefill_s": prefill_s,
                "tail_s": tail_s,
                "tail_vs_prefill": tail_s / prefill_s,
                "samples": xs,
            }
        )
        table.append(
            [n, mode, f"{prefill_s * 1e3:.0f}", f"{tail_s * 1e3:.1f}", f"{tail_s / prefill_s:.1%}"]
        )
    print_table(["prompt", "KV sent", "prefill ms", "tail ms", "tail / prefill"], table)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", default="both", choices=("wire", "prefill", "both"))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: the cache (and so the handoff) a byte a value",
    )
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=20, help="transfers per cell (part wire)")
    p.add_argument("--wire-runs", type=int, default=3, help="runs of part wire; medians shown")
    p.add_argument(
        "--prefill-lengths", default="1024", type=lambda v: [int(x) for x in v.split(",")]
    )
    p.add_argument("--runs", type=int, default=5, help="prompts per length and mode (part prefill)")
    p.add_argument("--out", type=Path, default=RESULTS / "kv_transfer.json")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": {k: str(v) for k, v in vars(args).items()}}
    if args.part in ("wire", "both"):
        result["wire"] = run_wire(args)
    if args.part in ("prefill", "both"):
        result["prefill"] = run_prefill(args)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def plot(rows, path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (
        ("raw_GBps", "raw send/recv, hot buffer"),
        ("raw_cold_GBps", "raw send/recv, cold buffer"),
        ("runs_GBps", "handoff, blocks in runs"),
        ("churned_GBps", "handoff, churned cache"),
        ("scattered_GBps", "handoff, scattered blocks"),
    ):
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV handoff over gloo on loopback, SmolLM2 layout, {dtype}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
