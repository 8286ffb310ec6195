"""The `tandem` command line.

tandem up [--config F] [--model M] [--prefill N] [--decode M] [--mode ...] [--port P] ...
tandem router [--config F] [cluster flags] --ray-address ADDR --redis-url URL [--port P]
tandem generate --offline [--model M] [--dtype D] [--requests FILE.jsonl] [--json] [PROMPT]
tandem generate --address HOST:PORT[,HOST:PORT...] [--requests FILE.jsonl] [--json] [PROMPT]
tandem status --address HOST:PORT [--json]
tandem doctor [--config F] [cluster flags] [--json]
tandem keys new --tenant T [--scopes generate,admin] | tandem keys hash < KEYFILE

`up`, `router`, `generate --offline` and `doctor` (which reports what torch sees, starting
nothing) load torch; the rest are thin gRPC clients.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from cluster import config_io
from cluster.requests_file import read_requests
from workers.completion import GenerationRequest
from workers.engine.config import EngineConfig
from workers.engine.request import SamplingParams


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    config_io.add_flags(p, EngineConfig, title="engine")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_io.load(EngineConfig, None, config_io.overrides_from_args(EngineConfig, args))


def _requests(args: argparse.Namespace) -> list[GenerationRequest]:
    if bool(args.requests) == bool(args.prompt):
        raise ValueError("give either a PROMPT or --requests FILE.jsonl")
    if args.requests:
        return read_requests(args.requests)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=getattr(args, "cfg__seed", None),
        n=args.n,
    )
    return [GenerationRequest(prompt=args.prompt, sampling=sampling)]


class _OrderedPrinter:
    """Streams the earliest unfinished request live; later ones are buffered and printed in
    input order once their turn comes, so the terminal reads top to bottom."""

    def __init__(self, headers: list[str], out=sys.stdout) -> None:
        """`headers`: one per slot (a request's choice), printed above it when there are
        several."""
        self.headers, self.total, self.out = headers, len(headers), out
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
                self.out.write(f"=== {self.headers[i]} ===\n")
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
    from workers.model.config import CheckpointError
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
        headers = [
            f"request {i}" + (f", choice {c}" if r.sampling.n > 1 else "")
            for i, r in enumerate(requests)
            for c in range(r.sampling.n)
        ]
        results = llm.generate(requests, on_delta=_OrderedPrinter(headers))
    llm.close()
    return 1 if any(c.finish_reason == "error" for c in results) else 0


def _doctor(args: argparse.Namespace) -> int:
    from cluster.doctor import cmd_doctor

    return cmd_doctor(args)


def build_parser() -> argparse.ArgumentParser:
    from cluster.cli_remote import (
        add_client_flags,
        cmd_drain,
        cmd_scale,
        cmd_status,
        cmd_tenants,
    )

    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions")
    gen.add_argument("prompt", nargs="?", help="one prompt, sent as a user chat message")
    gen.add_argument("--offline", action="store_true", help="run an in-process engine")
    gen.add_argument(
        "--address",
        help="a running cluster's router, HOST:PORT; several, comma-separated, to resume on "
        "the next one if a router dies",
    )
    gen.add_argument("--concurrency", type=int, default=16, help="with --address")
    gen.add_argument("--timeout", type=float, default=600, help="seconds per request")
    add_client_flags(gen)
    gen.add_argument("--requests", help="JSONL file, one request per line")
    gen.add_argument("--json", action="store_true", help="one JSON line per request, in order")
    gen.add_argument("--max-tokens", type=int, default=256, help="for a PROMPT (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="for a PROMPT (default 0)")
    gen.add_argument(
        "--n", type=int, default=1, help="for a PROMPT: completions to draw (default 1)"
    )
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)
    from cluster.cli_up import add_router_parser, add_up_parser

    add_up_parser(sub)
    add_router_parser(sub)
    doc = sub.add_parser(
        "doctor",
        help="what this machine offers and what the cluster config needs of it",
        description="Says what is here (CUDA and its GPUs, NCCL, flash-attn and its page-size "
        "rule, Triton, the CPU kernels, Redis, Ray and its auth mode), what the config needs, "
        "and what is missing (exit status 1). Starts nothing.",
    )
    doc.add_argument("--config", help="YAML or TOML file of cluster config fields")
    doc.add_argument("--json", action="store_true")
    from cluster.config import add_flags

    add_flags(doc)
    doc.set_defaults(func=_doctor)
    st = sub.add_parser("status", help="per-worker state of a running cluster")
    st.add_argument("--address", required=True)
    st.add_argument("--json", action="store_true")
    add_client_flags(st)
    st.set_defaults(func=cmd_status)
    sc = sub.add_parser(
        "scale",
        help="resize the prefill and/or decode pool",
        description="Grows a pool by starting workers, or shrinks it by draining its newest "
        "ones: a drained worker takes no new request, finishes those it holds (or, past the "
        "drain timeout, hands them to replay), closes its KV pairs, then exits.",
    )
    sc.add_argument("--address", required=True)
    sc.add_argument("--prefill", type=int, help="prefill workers wanted (>= 1)")
    sc.add_argument("--decode", type=int, help="decode workers wanted (>= 1)")
    sc.add_argument("--timeout", type=float, default=600, help="seconds per pool (default 600)")
    sc.add_argument("--json", action="store_true")
    add_client_flags(sc)
    sc.set_defaults(func=cmd_scale)
    dr = sub.add_parser(
        "drain",
        help="retire one worker without failing its requests",
        description="The worker takes no new request and finishes those it holds; past "
        "--drain-timeout they are replayed elsewhere. Then it exits and its pool shrinks by one.",
    )
    dr.add_argument("--address", required=True)
    dr.add_argument("--worker", required=True, help="its name, e.g. decode-1 (tandem status)")
    dr.add_argument("--drain-timeout", type=float, default=60, help="seconds (default 60)")
    dr.add_argument("--json", action="store_true")
    add_client_flags(dr)
    dr.set_defaults(func=cmd_drain)
    te = sub.add_parser(
        "tenants",
        help="read or change the tenants' weights, caps, quotas, tiers and max waits",
        description="Prints each tenant's policy and what it holds on the router; with --set, "
        "changes a tenant's fields first, from each router's next admission on (the entry "
        "'default' stands for every tenant not named). A change is shared through Redis: it "
        "holds at every router of the cluster, and across their restarts, until --reset "
        "puts the tenant back to the config's policy. A field set to 'none' goes back to "
        "the default entry's.",
    )
    te.add_argument("--address", required=True)
    te.add_argument(
        "--set",
        nargs=2,
        action="append",
        default=[],
        metavar=("TENANT", "FIELD=VALUE,..."),
        help="e.g. --set gold weight=4,tier=0,tokens_per_minute=60000 (repeatable)",
    )
    te.add_argument(
        "--reset",
        action="append",
        default=[],
        metavar="TENANT",
        help="undo every run-time change of a tenant: back to the config's (repeatable; "
        "applied before --set)",
    )
    te.add_argument("--json", action="store_true")
    add_client_flags(te)
    te.set_defaults(func=cmd_tenants)
    add_keys_parser(sub)
    return parser


def add_keys_parser(sub) -> None:
    keys = sub.add_parser(
        "keys",
        help="make API keys and the lines of a key file",
        description="A router's key file (router.api_keys_file) holds each key only as its "
        "SHA-256, with a tenant and scopes (generate, admin). `new` makes a key and prints it "
        "once with its line; `hash` prints the line of a key you have (read from standard "
        "input, so that it stays out of your shell's history).",
    )
    ks = keys.add_subparsers(dest="keys_command", required=True)
    new = ks.add_parser("new", help="a new random key, and its key-file line")
    new.add_argument("--tenant", required=True)
    new.add_argument("--scopes", default="generate", help="comma-separated (default generate)")
    new.set_defaults(func=_keys_new)
    h = ks.add_parser("hash", help="the key-file line of a key read from standard input")
    h.add_argument("--tenant", default="default")
    h.add_argument("--scopes", default="generate", help="comma-separated (default generate)")
    h.set_defaults(func=_keys_hash)


def _key_line(key: str, args: argparse.Namespace) -> str:
    from router.edge.keys import SCOPES, TENANT, key_hash

    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    bad = [s for s in scopes if s not in SCOPES]
    if not scopes or bad:
        raise SystemExit(f"tandem keys: --scopes: from {', '.join(SCOPES)} (got {args.scopes!r})")
    if not TENANT.fullmatch(args.tenant):
        raise SystemExit("tandem keys: --tenant: 1-64 characters from letters, digits and . _ -")
    return f"  - {{sha256: {key_hash(key)}, tenant: {args.tenant}, scopes: [{', '.join(scopes)}]}}"


def _keys_new(args: argparse.Namespace) -> int:
    import secrets

    key = "tdm-" + secrets.token_urlsafe(32)
    line = _key_line(key, args)
    print(f"key (shown once; give it to the client, e.g. as TANDEM_API_KEY): {key}")
    print(f"key file line (under keys:):\n{line}")
    return 0


def _keys_hash(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("tandem keys hash: give the key on standard input", file=sys.stderr)
        return 2
    print(_key_line(key, args))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
