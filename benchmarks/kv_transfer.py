"""KV handoff bandwidth and latency against raw torch.distributed send/recv of the same bytes.

    python benchmarks/kv_transfer.py [--dtype float32] [--lengths 128,512,1024,4096] [--iters 10]

Two processes on loopback, each with one thread, joined by a gloo pair group exactly as a
prefill and a decode worker are (TCPStore rendezvous, PairGroup). For each prompt length, the
KV of SmolLM2-135M's layout is moved three ways, same bytes each time:
- raw: one contiguous tensor sent with the group's send/recv, then a 1-element ack back;
- handoff (wire): Tandem's protocol (header, one tensor per layer, ack), tensors prepared;
- handoff (end to end): plus the sender's export (gathering each layer's blocks out of its
  paged cache while earlier layers are on the wire) and the receiver's import (scattering
  each layer into the reserved blocks as it lands), as the workers run it.
Median of --iters per cell; bandwidth is bytes / median seconds. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import RESULTS, print_table  # noqa: E402
from kv_transfer.channel import StagingBuffers, recv_kv, send_kv  # noqa: E402
from kv_transfer.layout import KVLayout  # noqa: E402
from kv_transfer.protocol import TransferDescriptor  # noqa: E402
from kv_transfer.torch_dist import PairGroup, store_client, store_server  # noqa: E402

CACHE_BLOCKS = 1024


def layout_for(dtype: str) -> KVLayout:
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)


def make_cache(layout: KVLayout):
    shape = (CACHE_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [
        (torch.randn(shape).to(layout.torch_dtype), torch.randn(shape).to(layout.torch_dtype))
        for _ in range(layout.num_layers)
    ]


def export_layer(cache, i: int, blocks: torch.Tensor) -> torch.Tensor:
    # The same gather the prefill worker runs (ModelRunner.export_layer).
    k, v = cache[i]
    out = torch.empty((2, len(blocks), *k.shape[1:]), dtype=k.dtype)
    torch.index_select(k, 0, blocks, out=out[0])
    torch.index_select(v, 0, blocks, out=out[1])
    return out


def import_layer(cache, i: int, blocks: torch.Tensor, layer: torch.Tensor) -> None:
    k, v = cache[i]
    k.index_copy_(0, blocks, layer[0])
    v.index_copy_(0, blocks, layer[1])


def worker(rank: int, port_file: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    layout = layout_for(args["dtype"])
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
    gen = torch.Generator().manual_seed(0)
    results = []
    for length in args["lengths"]:
        n_blocks = -(-length // layout.block_size)
        blocks = torch.randperm(CACHE_BLOCKS, generator=gen)[:n_blocks]
        nbytes = layout.bytes_per_block * n_blocks
        raw = torch.zeros(nbytes // layout.torch_dtype.itemsize, dtype=layout.torch_dtype)
        ack = torch.zeros(1, dtype=torch.int64)
        desc = TransferDescriptor(f"req-{length}", layout, n_blocks, length, 7)
        prepared = [export_layer(cache, j, blocks) for j in range(layout.num_layers)]
        staging = StagingBuffers()
        timings = {"raw": [], "wire": [], "end_to_end": []}
        for i in range(args["iters"] + 1):  # the first round warms up
            # raw
            group.send([ack], 60) if rank == 0 else group.recv([ack], 60)  # line up both sides
            t = time.perf_counter()
            if rank == 0:
                group.send([raw], 60)
                group.recv([ack], 60)
            else:
                group.recv([raw], 60)
                group.send([ack], 60)
            dt_raw = time.perf_counter() - t
            # handoff, wire only
            group.send([ack], 60) if rank == 0 else group.recv([ack], 60)
            t = time.perf_counter()
            if rank == 0:
                send_kv(group, desc, prepared, 60)
            else:
                recv_kv(group, layout, 60, staging=staging)
            dt_wire = time.perf_counter() - t
            # handoff, end to end
            group.send([ack], 60) if rank == 0 else group.recv([ack], 60)
            t = time.perf_counter()
            if rank == 0:  # gather each layer while the previous ones are on the wire
                send_kv(
                    group,
                    desc,
                    (export_layer(cache, j, blocks) for j in range(layout.num_layers)),
                    60,
                )
            else:  # scatter each layer into the cache as it lands
                recv_kv(
                    group,
                    layout,
                    60,
                    staging=staging,
                    on_layer=lambda j, t, b=blocks: import_layer(cache, j, b, t),
                )
            dt_e2e = time.perf_counter() - t
            if i:
                timings["raw"].append(dt_raw)
                timings["wire"].append(dt_wire)
                timings["end_to_end"].append(dt_e2e)
        results.append(
            {
                "prompt_tokens": length,
                "bytes": nbytes,
                **{k: statistics.median(v) for k, v in timings.items()},
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    group.close()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS / "kv_transfer.json")
    args = p.parse_args()
    job = {
        "dtype": args.dtype,
        "lengths": [int(x) for x in args.lengths.split(",")],
        "iters": args.iters,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    port_file = str(args.out.with_suffix(".port"))
    tmp = str(args.out.with_suffix(".tmp"))
    Path(port_file).unlink(missing_ok=True)
    mp.spawn(worker, args=(port_file, job, tmp), nprocs=2, join=True)
    Path(port_file).unlink(missing_ok=True)
    rows = json.loads(Path(tmp).read_text())
    Path(tmp).unlink()
    table = []
    for r in rows:
        gbps = {k: r["bytes"] / r[k] / 1e9 for k in ("raw", "wire", "end_to_end")}
        r.update({f"{k}_GBps": v for k, v in gbps.items()})
        r["wire_vs_raw"] = gbps["wire"] / gbps["raw"]
        r["end_to_end_vs_raw"] = gbps["end_to_end"] / gbps["raw"]
        table.append(
            [
                r["prompt_tokens"],
                f"{r['bytes'] / 2**20:.1f}",
                f"{r['raw'] * 1e3:.2f}",
                f"{r['wire'] * 1e3:.2f}",
                f"{r['end_to_end'] * 1e3:.2f}",
                f"{gbps['raw']:.2f}",
                f"{gbps['wire']:.2f}",
                f"{gbps['end_to_end']:.2f}",
                f"{r['wire_vs_raw']:.0%}",
                f"{r['end_to_end_vs_raw']:.0%}",
            ]
        )
    print_table(
        [
            "prompt",
            "MiB",
            "raw ms",
            "wire ms",
            "e2e ms",
            "raw GB/s",
            "wire GB/s",
            "e2e GB/s",
            "wire/raw",
            "e2e/raw",
        ],
        table,
    )
    args.out.write_text(json.dumps({"config": job, "results": rows}, indent=2))
    plot(rows, args.out.with_suffix(".png"), args.dtype)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(rows, path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (
        ("raw_GBps", "raw send/recv"),
        ("wire_GBps", "handoff (wire)"),
        ("end_to_end_GBps", "handoff (with export/import)"),
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
