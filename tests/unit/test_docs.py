"""The README and the docs are checked against the code: every file they name exists, every
`Class.member` they name is there, and every `tandem` command they show parses with the CLI's
own parser."""

import importlib
import inspect
import re
import shlex
from pathlib import Path

import pytest

from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
OURS = r"`((?:router|workers|cluster|kv_transfer|client)/[\w/]+\.py)`"  # a file of ours, named
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = (
    "kv_transfer",
    "workers",
    "router",
    "client",
    "cluster",
    "benchmarks",
    "deploy",
    "tests",
)


def doc_ids():
    return [pytest.param(p, id=p.name) for p in DOCS]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("doc", doc_ids())
def test_every_file_a_doc_names_exists(doc):
    missing = []
    for span in code_spans(doc.read_text()):
        for word in span.split():
            word = word.strip(",;:()")
            written = word.startswith("benchmarks/results/")  # what a benchmark run writes
            if (
                word.startswith(PACKAGES)
                and not written
                and re.search(r"\.(py|yaml|json|sh|cpp|md)$", word)
            ):
                if not (ROOT / word).exists():
                    missing.append(word)
    assert not missing, f"{doc.name} names files that are not there: {missing}"


def named_members(text: str) -> list[tuple[str, str, str]]:
    """(file, class, member) for each '**`path.py`** `Class.member`' or '`path.py`
    `Class.member`' in the text: a member named beside its file."""
    return re.findall(r"`([\w/]+\.py)`\**\s+`(\w+)\.(\w+)`", text)


def has_member(cls: type, member: str) -> bool:
    """A method or class attribute, or an attribute its methods set on the instance."""
    return (
        hasattr(cls, member)
        or re.search(rf"self\.{member}\s*[:=]", inspect.getsource(cls)) is not None
    )


def test_every_class_member_the_architecture_names_is_in_its_file():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = named_members(text)
    assert len(named) >= 8
    for path, cls, member in named:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert has_member(getattr(module, cls), member), f"{path}: {cls}.{member} is not there"
    # And those named alone, by class: each class is found in the files the doc names.
    modules = [
        importlib.import_module(p.removesuffix(".py").replace("/", "."))
        for p in set(re.findall(OURS, text))
    ]
    for cls, member in set(re.findall(r"`([A-Z]\w+)\.(\w+)`", text)):
        owners = [getattr(m, cls) for m in modules if hasattr(m, cls)]
        assert owners and all(has_member(o, member) for o in owners), f"{cls}.{member}"


def tandem_commands(text: str) -> list[list[str]]:
    """Every `tandem ...` line of the docs' code blocks, with optional `[...]` parts and
    placeholders dropped."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if not line.startswith("tandem "):
                continue
            line = re.sub(r"\[[^\]]*\]", "", line)
            found.append(shlex.split(line)[1:])
    return found


@pytest.mark.parametrize("doc", doc_ids())
def test_every_tandem_command_in_the_docs_parses(doc):
    parser = build_parser()
    for argv in tandem_commands(doc.read_text()):
        parser.parse_args(argv)  # an unknown command or flag exits (SystemExit) here
