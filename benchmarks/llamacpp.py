"""Tandem against llama.cpp on the same GGUF files, the same prompts and the same threads, in
one run: Tandem serving the file's blocks as stored (quantization: gguf), Tandem at full width
(the file dequantized at load, bf16), and llama.cpp (its Python package, built from source in
an environment of its own).

    python benchmarks/llamacpp.py [--types Q8_0,Q4_1] [--batches 1,16] [--max-tokens 128]
        [--runs 3] [--threads 2] [--llamacpp-python P] [--out F.json]

Each --types value is one file: Q4_1 is the default model's own; another type is the default
model's weights written in that type once (benchmarks/common.py's export_gguf). For each batch
B, the first B prompts of the offline workload (through the chat template once, so both see
the same token ids) are prefilled and decoded together, --max-tokens each, greedy, EOS
ignored: tokens/s is B x max_tokens over the whole run, and over its decode alone (after the
last first token). llama.cpp runs `benchmarks/_llamacpp_run.py` in its own interpreter
(--llamacpp-python, or TANDEM_LLAMACPP_PYTHON; default ~/.cache/tandem/llamacpp-venv); install
it there with `python -m venv ~/.cache/tandem/llamacpp-venv && ~/.cache/tandem/llamacpp-venv/
bin/pip install llama-cpp-python` (it compiles llama.cpp for this CPU: about 25 minutes on
2 cores). Every run warms up once, then --runs timed runs; tables give medians. Writes JSON to
benchmarks/results/llamacpp.json with the CPU model and flags, and llama.cpp's own build flags.

Targets (issue 42): Tandem at least 1.0x llama.cpp's tokens/s at batch 1, ahead at batch 16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ROOT,
    default_gguf,
    describe_machine,
    export_gguf,
    load_workload,
    log,
    machine,
    median,
    print_table,
    run_worker,
)

DEFAULT_LLAMACPP_PYTHON = Path(
    os.environ.get(
        "TANDEM_LLAMACPP_PYTHON",
        Path.home() / ".cache" / "tandem" / "llamacpp-venv" / "bin" / "python",
    )
)
WORKLOAD = ROOT / "benchmarks" / "workloads" / "offline_default.jsonl"
SYSTEMS = ("tandem-gguf", "tandem", "llama.cpp")


def run_tandem(job: dict) -> dict:
    """Tandem's engine on the job's prompts, the same way: all added, stepped to the end."""
    import torch

    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams

    torch.set_num_threads(job["threads"])
    n = len(job["prompts"])
    engine = LLMEngine(
        EngineConfig(
            model=job["gguf"],
            dtype="bfloat16",
            device="cpu",
            quantization=job["quantization"],
            max_num_seqs=n,
            num_threads=job["threads"],
            enable_prefix_caching=False,  # each run prefills, as llama.cpp's (cleared) does
        )
    )
    sampling = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)

    def once() -> tuple[float, float, list[list[int]]]:
        ids = [engine.add_request(p, sampling) for p in job["prompts"]]
        out: dict[str, list[int]] = {i: [] for i in ids}
        t0 = time.perf_counter()
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            if first is None and all(out.values()):
                first = time.perf_counter()
        end = time.perf_counter()
        return first - t0, end - first, [out[i] for i in ids]

    once()  # warm-up
    runs, outputs = [], []
    for _ in range(job["runs"]):
        prefill, decode, outputs = once()
        runs.append({"wall_s": prefill + decode, "prefill_s": prefill, "decode_s": decode})
    return {"runs": runs, "outputs": outputs}


def summarise(result: dict, n: int, max_tokens: int) -> dict:
    runs = result["runs"]
    tokens = n * max_tokens
    return {
        "tokens_per_s": median([tokens / r["wall_s"] for r in runs]),
        "decode_tokens_per_s": median([n * (max_tokens - 1) / r["decode_s"] for r in runs]),
        "prefill_s": median([r["prefill_s"] for r in runs]),
        "runs": runs,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean share of each sequence's tokens before the two first differ."""
    shares = []
    for x, y in zip(a, b):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(same / max(1, len(x)))
    return sum(shares) / max(1, len(shares))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", default="Q8_0,Q4_1", help="GGUF types, one file each")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--llamacpp-python", type=Path, default=DEFAULT_LLAMACPP_PYTHON)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run of a system")
    p.add_argument("--out", type=Path, default=RESULTS / "llamacpp.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_tandem(json.load(sys.stdin))), flush=True)
        return
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "llama.cpp" in systems and not args.llamacpp_python.is_file():
        p.error(
            f"llama.cpp's interpreter {args.llamacpp_python} is missing: install "
            "llama-cpp-python in a venv of its own (see this script's help), or leave "
            "llama.cpp out of --systems"
        )
    batches = [int(b) for b in args.batches.split(",") if b]
    files = {}
    for t in (t for t in args.types.split(",") if t):
        ours = default_gguf()
        is_default = t == "Q4_1"
        files[t] = (
            ours
            if is_default
            else export_gguf(t, RESULTS / f"smollm2-135m-instruct-{t.lower()}.gguf")
        )
    model_dir = default_gguf()
    prompts = [r["prompt_ids"] for r in load_workload(WORKLOAD, model_dir, max(batches))]
    m = machine()
    log(f"machine: {describe_machine(m)}")
    results: dict = {}
    for qtype, path in files.items():
        for b in batches:
            for system in systems:
                job = {
                    "gguf": str(path),
                    "prompts": prompts[:b],
                    "max_tokens": args.max_tokens,
                    "threads": args.threads,
                    "runs": args.runs,
                    "quantization": "gguf" if system == "tandem-gguf" else "none",
                }
                if system == "llama.cpp":
                    cmd = [str(args.llamacpp_python), str(ROOT / "benchmarks" / "_llamacpp_run.py")]
                else:
                    cmd = [sys.executable, __file__, "--worker"]
                raw, failure = run_worker(f"{qtype} batch {b} {system}", cmd, job, args.timeout)
                if raw is None:
                    results[f"{qtype}/{b}/{system}"] = {"failed": failure}
                    continue
                row = summarise(raw, b, args.max_tokens)
                row["outputs"] = raw["outputs"]
                if "system_info" in raw:
                    row["llamacpp"] = {"version": raw["version"], "system_info": raw["system_info"]}
                log(f"  {row['tokens_per_s']:.1f} tok/s, decode {row['decode_tokens_per_s']:.1f}")
                results[f"{qtype}/{b}/{system}"] = row
    table = []
    for qtype in files:
        for b in batches:
            ref = results.get(f"{qtype}/{b}/llama.cpp")
            ref = ref if ref and "failed" not in ref else None
            for system in systems:
                r = results[f"{qtype}/{b}/{system}"]
                if "failed" in r:
                    table.append([qtype, b, system, "failed", "", "", "", ""])
                    continue
                vs = (
                    f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x"
                    if ref and system != "llama.cpp"
                    else "-"
                )
                agree = f"{agreement(r['outputs'], ref['outputs']):.0%}" if ref else "-"
                table.append(
                    [
                        qtype,
                        b,
                        system,
                        f"{r['tokens_per_s']:.1f}",
                        f"{r['decode_tokens_per_s']:.1f}",
                        f"{r['prefill_s'] * 1000:.0f}",
                        vs,
                        agree,
                    ]
                )
    print(describe_machine(m))
    print_table(
        [
            "file",
            "batch",
            "system",
            "tok/s",
            "decode tok/s",
            "prefill ms",
            "of llama.cpp",
            "tokens as llama.cpp's",
        ],
        table,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": m,
        "types": list(files),
        "batches": batches,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "threads": args.threads,
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
