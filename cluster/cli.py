"""The `tandem` command line.

tandem up [--config F] [--model M] [--prefill N] [--decode M] [--mode ...] [--port P] ...
tandem generate --offline [--model M] [--dtype D] [--requests FILE.jsonl] [--json] [PROMPT]
tandem generate --address HOST:PORT [--requests FILE.jsonl] [--concurrency N] [--json] [PROMPT]
tandem status --address HOST:PORT [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from cluster.requests_file import read_requests
from workers.engine.config import DTYPES, EngineConfig
from workers.engine.request import SamplingParams
from workers.model.config import CheckpointError
from workers.offline import GenerationRequest


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file or an HF folder (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument(
        "--attention-backend", default="auto", choices=("auto", "torch", "torch-sdpa", "flash-attn")
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-gb", type=float, default=1.0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--policy", default="fcfs", choices=("fcfs", "priority"))
    g.add_argument("--batching", default="continuous", choices=("continuous", "static"))
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_gb,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        prefill_chunk_size=args.prefill_chunk_size,
        enable_prefix_caching=not args.no_prefix_caching,
        policy=args.policy,
        batching=args.batching,
        num_threads=args.threads,
    )


def _requests(args: argparse.Namespace) -> list[GenerationRequest]:
    if bool(args.requests) == bool(args.prompt):
        raise ValueError("give either a PROMPT or --requests FILE.jsonl")
    if args.requests:
        return read_requests(args.requests)
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    return [GenerationRequest(prompt=args.prompt, sampling=sampling)]


class _OrderedPrinter:
    """Streams the earliest unfinished request live; later ones are buffered and printed in
    input order once their turn comes, so the terminal reads top to bottom."""

    def __init__(self, total: int, out=sys.stdout) -> None:
        self.total, self.out = total, out
        self.pending: dict[int, list[str]] = {}
        self.finished: set[int] = set()
        self.current = 0
        self.headed = -1

    def __call__(self, index: int, delta: str, finished: bool) -> None:
        self.pending.setdefault(index, []).append(delta)
        if finished:
            self.finished.add(index)
        while self.current < self.total:
            i = self.current
            if self.total > 1 and self.headed < i:
                self.out.write(f"=== request {i} ===\n")
                self.headed = i
            self.out.write("".join(self.pending.pop(i, [])))
            if i not in self.finished:
                break
            self.out.write("\n")
            self.current += 1
        self.out.flush()


def _progress(done: int, total: int, tokens: int, t0: list[float]) -> None:
    now = time.perf_counter()
    if done == total or now - t0[1] > 2.0:
        t0[1] = now
        rate = tokens / max(now - t0[0], 1e-9)
        print(
            f"[tandem] {done}/{total} requests done, {tokens} tokens, {rate:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    if bool(args.offline) == bool(args.address):
        print(
            "tandem generate: give --offline (in-process engine) or --address HOST:PORT",
            file=sys.stderr,
        )
        return 2
    try:
        requests = _requests(args)
        config = engine_config(args) if args.offline else None
    except ValueError as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    if args.address:
        import asyncio

        from cluster.cli_remote import generate_remote

        return asyncio.run(generate_remote(args, requests))
    from workers.offline import LLM

    print("[tandem] loading model...", file=sys.stderr, flush=True)
    try:
        llm = LLM(config)
    except (CheckpointError, ValueError, RuntimeError) as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    clock = [time.perf_counter()] * 2
    progress = lambda d, t, n: _progress(d, t, n, clock)  # noqa: E731
    if args.json:
        results = llm.generate(requests, on_progress=progress)
        for c in results:
            print(json.dumps(c.to_json()), flush=True)
    else:
        results = llm.generate(requests, on_delta=_OrderedPrinter(len(requests)))
    return 1 if any(c.finish_reason == "error" for c in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions")
    gen.add_argument("prompt", nargs="?", help="one prompt, sent as a user chat message")
    gen.add_argument("--offline", action="store_true", help="run an in-process engine")
    gen.add_argument("--address", help="a running cluster's router, HOST:PORT")
    gen.add_argument("--concurrency", type=int, default=16, help="with --address")
    gen.add_argument("--timeout", type=float, default=600, help="seconds per request")
    gen.add_argument("--token", help="bearer token, if the cluster requires one")
    gen.add_argument("--requests", help="JSONL file, one request per line")
    gen.add_argument("--json", action="store_true", help="one JSON line per request, in order")
    gen.add_argument("--max-tokens", type=int, default=256, help="for a PROMPT (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="for a PROMPT (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="for a PROMPT")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    from cluster.cli_remote import cmd_status
    from cluster.cli_up import add_up_parser

    add_up_parser(sub)
    st = sub.add_parser("status", help="per-worker state of a running cluster")
    st.add_argument("--address", required=True)
    st.add_argument("--json", action="store_true")
    st.add_argument("--token")
    st.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
