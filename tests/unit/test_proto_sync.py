"""The committed protobuf modules match proto/tandem.proto, and nothing is importable as a
top-level `proto` module of ours (proto-plus owns that name)."""

from pathlib import Path

from router.api.generate import OUT, generated_texts


def test_generated_modules_are_in_sync_with_the_proto():
    for name, text in generated_texts().items():
        committed = (OUT / name).read_text()
        assert committed == text, f"{name} is stale: run python -m router.api.generate"


def test_no_top_level_proto_package():
    root = Path(__file__).resolve().parents[2]
    assert not (root / "proto" / "__init__.py").exists()
    assert not list((root / "proto").glob("*.py"))
