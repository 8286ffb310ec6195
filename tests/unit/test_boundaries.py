"""Package boundaries: imports point one way, and the client side starts without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kv_transfer", "workers", "router", "cluster")


def layer(module: str) -> int | None:
    """Bottom to top: kv_transfer and workers.model, workers.engine, the worker actors,
    router, cluster. None: not ours."""
    if module.startswith(("kv_transfer", "workers.model")):
        return 0
    if module.startswith("workers.engine"):
        return 1
    if module.startswith("workers"):
        return 2
    if module.startswith("router"):
        return 3
    if module.startswith("cluster"):
        return 4
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_imports_never_point_up():
    wrong = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            me = module_name(path)
            mine = layer(me)
            for target in imports(path):
                theirs = layer(target)
                if theirs is not None and theirs > mine:
                    wrong.append(f"{me} imports {target}")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


HELP = (
    "from cluster.cli import main\n"
    "try:\n    main(['{command}', '--help'])\n"
    "except SystemExit:\n    pass"
)


@pytest.mark.parametrize(
    "code",
    [
        "import router.client",
        "import cluster.cli_remote, workers.messages, router.convert",
        HELP.format(command="status"),
        HELP.format(command="up"),
    ],
    ids=["router.client", "client-side modules", "tandem status --help", "tandem up --help"],
)
def test_client_side_starts_without_torch(code):
    check = (
        code + "\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", "torch was imported"
