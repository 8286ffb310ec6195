"""benchmarks/gpu_check.py, the first thing to run on a GPU, runs on the CPU in the suite
(`--device cpu --quick`), so that it never rots: every check it makes passes there too."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = {
    "environment",
    "engine-greedy",
    "engine-seeded",
    "engine-chunked-prefill",
    "engine-prefix-cache",
    "sampler",
    "kv-protocol",
    "gloo-stalled-op",
    "gloo-peer-never-joins",
    "graphs",
    "decode-step-bf16",
}


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_gpu_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--json", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(results) == CHECKS
    assert all(r["status"] == "PASS" for r in results.values()), run.stdout
    assert run.stdout.splitlines()[-1] == f"{len(CHECKS)} of {len(CHECKS)} checks passed on cpu"
    steps = results["decode-step-bf16"]["data"]
    assert set(steps) == {"batch 1", "batch 16", "batch 64"} and all(v > 0 for v in steps.values())
