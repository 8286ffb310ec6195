"""Package boundaries: imports point one way, and the client side starts without torch."""

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kv_transfer", "workers", "router", "client", "cluster")


def layer(module: str) -> int | None:
    """Bottom to top: kv_transfer and workers.model, workers.engine, the worker actors,
    router, the client library, cluster. None: not ours."""
    if module.startswith(("kv_transfer", "workers.model")):
        return 0
    if module.startswith("workers.engine"):
        return 1
    if module.startswith("workers"):
        return 2
    if module.startswith("router"):
        return 3
    if module == "client" or module.startswith("client."):
        return 4
    if module.startswith("cluster"):
        return 5
    return None


# The router's parts, bottom to top: what every part may use (its config and the tenants'
# policies, errors, metrics and the generated API), records and the fleet, admission,
# requests, the controller duties, and the edge where calls come in.
ROUTER_PARTS = (
    ("router.api", "router.config", "router.errors", "router.metrics", "router.tenant_policy"),
    ("router.records", "router.fleet"),
    ("router.admission",),
    ("router.requests",),
    ("router.controller",),
    ("router.edge",),
)


def router_part(module: str) -> int | None:
    for i, parts in enumerate(ROUTER_PARTS):
        if any(module == p or module.startswith(p + ".") for p in parts):
            return i
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


def upward_imports(rank) -> list[str]:
    """Every import, in our packages, of a module that `rank` puts above the importer."""
    wrong = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            me = module_name(path)
            mine = rank(me)
            for target in imports(path):
                theirs = rank(target)
                if mine is not None and theirs is not None and theirs > mine:
                    wrong.append(f"{me} imports {target}")
    return wrong


def test_imports_never_point_up():
    wrong = upward_imports(layer)
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_the_routers_parts_never_import_a_part_above():
    every = {module_name(p) for p in (ROOT / "router").rglob("*.py")}
    assert all(router_part(m) is not None for m in every if m != "router"), sorted(
        m for m in every if m != "router" and router_part(m) is None
    )
    wrong = upward_imports(router_part)
    assert not wrong, "upward imports between the router's parts:\n" + "\n".join(wrong)


HELP = (
    "from cluster.cli import main\n"
    "try:\n    main(['{command}', '--help'])\n"
    "except SystemExit:\n    pass"
)


@pytest.mark.parametrize(
    "code",
    [
        "import client",
        "import cluster.cli_remote, workers.messages, router.edge.convert",
        HELP.format(command="status"),
        HELP.format(command="up"),
    ],
    ids=["client", "client-side modules", "tandem status --help", "tandem up --help"],
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


def import_graph(pkg: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (TYPE_CHECKING ones included:
    a circle drawn only for type hints is still a circle to read)."""
    modules = {module_name(p): p for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for me, path in modules.items():
        graph[me] = {t for t in imports(path) if t in modules and t != me}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_circle_within_a_package(pkg):
    found = cycle(import_graph(pkg))
    assert found is None, "import circle: " + " -> ".join(found)


def test_the_circle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def private_methods() -> set[str]:
    """Names of every leading-underscore method a class of ours defines."""
    names = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            if item.name.startswith("_") and not item.name.startswith("__"):
                                names.add(item.name)
    return names


def test_no_class_calls_another_by_a_private_name():
    """`other._method()` reaches past another object's interface: only `self`, `cls` and
    `super()` may call a leading-underscore method of ours."""
    private = private_methods()
    wrong = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                attr, owner = node.func.attr, node.func.value
                if attr not in private:
                    continue
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} calls .{attr}()")
    assert not wrong, "\n".join(wrong)


def public_members(cls: type) -> set[str]:
    """A class's public methods and properties, and the public attributes its __init__ sets."""
    names = {n for n in vars(cls) if not n.startswith("_")}
    init = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    for node in ast.walk(init):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                if not node.attr.startswith("_"):
                    names.add(node.attr)
    return names


def test_the_router_and_the_decode_worker_stay_small():
    from router.requests.core import Router
    from workers.decode import DecodeWorker

    members = public_members(Router)
    # Each job is a room of its own (fleet, records, admission, metrics): the Router holds
    # them and the table of requests it drives, not their work.
    assert len(members) <= 16, sorted(members)
    methods = [n for n, v in vars(DecodeWorker).items() if inspect.isfunction(v)]
    assert len(methods) <= 12, methods
