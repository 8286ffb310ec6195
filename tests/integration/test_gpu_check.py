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
    "overlap",
}
# The quick form's figures, each against its floor (the card's bandwidth has none).
FIGURES = {"read-bandwidth", "decode-step-b1", "decode-step-b16", "prefill", "offline"}


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
    doc = json.loads(out.read_text())
    results = {r["name"]: r for r in doc["checks"]}
    assert set(results) == CHECKS
    assert all(r["status"] == "PASS" for r in results.values()), run.stdout
    assert run.stdout.splitlines()[-1] == f"{len(CHECKS)} of {len(CHECKS)} checks passed on cpu"
    figures = {f["name"]: f for f in doc["figures"]}
    assert set(figures) == FIGURES, run.stdout
    assert all(f["value"] > 0 for f in figures.values())
    for name in FIGURES - {"read-bandwidth"}:
        f = figures[name]
        assert f["floor"] > 0 and f["ratio"] > 0, f
    # A step is never faster than its own matmuls (noise aside): the floor is a floor.
    assert figures["decode-step-b16"]["ratio"] > 0.5, figures["decode-step-b16"]
