"""Runs a kernel test module's checks (its CHECKS: name -> function) and reports each as "ok"
or its failure; on the CPU in Triton's interpreter, in a subprocess of its own:
TRITON_INTERPRET must be set before triton is imported, and the test process may have
imported it already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_checks(checks: dict, *args) -> dict[str, str]:
    """Every check, called with `args`: "ok" or the failure, by name; or {"unavailable":
    why} where Triton cannot run."""
    from workers.model.triton_base import triton_unavailable

    reason = triton_unavailable()
    if reason is not None:
        return {"unavailable": reason}
    report = {}
    for name, check in checks.items():
        try:
            check(*args)
            report[name] = "ok"
        except AssertionError as e:
            report[name] = str(e)[-2000:] or "assertion failed"
    return report


def interpreted(module: str, *args, timeout_s: float = 300) -> dict[str, str]:
    """`module`'s CHECKS run in the interpreter, in a subprocess; skips the test where Triton
    is not installed or cannot run."""
    pytest.importorskip("triton", reason="triton is not installed: no kernel to test")
    code = (
        "import json, torch; torch.set_num_threads(2)\n"
        "import tests.unit.triton_interpreter  # noqa: F401 (Triton < 3.7 under NumPy 2.4+)\n"
        f"from tests.unit.triton_checks import run_checks\n"
        f"from {module} import CHECKS\n"
        f"print(json.dumps(run_checks(CHECKS, *{args!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"triton cannot run here: {report['unavailable']}")
    return report
