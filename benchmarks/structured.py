"""What constrained decoding costs a decode step: every row of the batch under a JSON schema
against the same batch unconstrained, Tandem's engine (llguidance, masks built while the
model runs) beside vLLM's CPU build (its default structured-output backend), in one run.

    python benchmarks/structured.py [--batches 1,16] [--context 128] [--steps 32] [--runs 3]
        [--systems tandem,vllm] [--out F]

Each system runs in its own process on the same --threads cores, through
benchmarks/step_latency.py's workers: B prompts of C random token ids are prefilled untimed,
then each step in which every sequence decodes one token is timed (scheduling, model, masks,
sampling, output handling); a run's figure is the median step, the table the median of
--runs runs. The schema (below) asks for a list of at least 64 people, so no sequence can end
inside the timed steps; its outputs mix forced keys, free strings and bounded integers.
Writes JSON and a PNG plot to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string"},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["name", "age", "role"],
            },
        }
    },
    "required": ["people"],
}


def main() -> None:
    from benchmarks import step_latency
    from benchmarks.common import (
        DEFAULT_VLLM_PYTHON,
        RESULTS,
        export_default_model,
        log,
        print_table,
    )

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default="tandem,vllm")
    p.add_argument("--vllm-python", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system and mode")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    batches = step_latency.ints(args.batches)
    systems = args.systems.split(",")
    if not batches or min(batches) <= 0 or args.context <= 0 or args.steps <= 0:
        p.error("--batches, --context and --steps need positive values")
    if set(systems) - {"tandem", "vllm"}:
        p.error("--systems: tandem, vllm")
    out = args.out or RESULTS / "structured.json"
    base = {
        "model_dir": str(export_default_model(RESULTS / "smollm2-135m-instruct-hf")),
        "dtype": args.dtype,
        "batches": batches,
        "contexts": [args.context],
        "prefills": [],
        "steps": args.steps,
        "runs": args.runs,
        "threads": args.threads,
        "vllm_default_binding": False,
    }
    vllm_python = args.vllm_python or DEFAULT_VLLM_PYTHON
    results: dict[str, dict] = {}
    for system in systems:
        for mode, schema in (("plain", None), ("json_schema", SCHEMA)):
            log(f"{system}, {mode}")
            job = base | {"json_schema": schema}
            results[f"{system}/{mode}"] = step_latency.run_system(
                f"{system}/{mode}", system, job, vllm_python, args.timeout
            )
    rows, summary = [], {}
    for system in systems:
        plain = {r["batch"]: r for r in results[f"{system}/plain"].get("decode", [])}
        guided = {r["batch"]: r for r in results[f"{system}/json_schema"].get("decode", [])}
        for b in batches:
            if b not in plain or b not in guided:
                why = results[f"{system}/json_schema"].get("error") or results[
                    f"{system}/plain"
                ].get("error", "skipped")
                rows.append([system, b, "-", "-", "-", str(why)[:60]])
                continue
            slow = guided[b]["median_ms"] / plain[b]["median_ms"] - 1
            summary[f"{system}/batch{b}"] = {
                "plain_ms": plain[b]["median_ms"],
                "constrained_ms": guided[b]["median_ms"],
                "slowdown": slow,
            }
            rows.append(
                [
                    system,
                    b,
                    f"{plain[b]['median_ms']:.1f}",
                    f"{guided[b]['median_ms']:.1f}",
                    f"{100 * slow:+.1f}%",
                    " ".join(f"{x:.1f}" for x in guided[b]["runs_ms"]),
                ]
            )
    print_table(
        ["system", "batch", "plain ms", "json_schema ms", "slower by", "constrained runs"], rows
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in base.items() if k != "model_dir"} | {"schema": SCHEMA}
    out.write_text(json.dumps({"config": meta, "summary": summary, "results": results}, indent=2))
    plot(summary, systems, batches, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(summary: dict, systems: list[str], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / (2 * len(systems))
    for i, system in enumerate(systems):
        for j, mode in enumerate(("plain_ms", "constrained_ms")):
            xs = [k + (2 * i + j) * width for k in range(len(batches))]
            ys = [summary.get(f"{system}/batch{b}", {}).get(mode, 0) for b in batches]
            label = f"{system} {'plain' if j == 0 else 'json_schema'}"
            ax.bar(xs, ys, width, label=label, hatch="//" if j else None)
    ax.set_xticks(
        [k + 0.4 - width / 2 for k in range(len(batches))], [f"batch {b}" for b in batches]
    )
    ax.set_ylabel("decode step p50, ms")
    ax.set_title("every row constrained vs none", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
