"""What a constrained request's output must be: a JSON schema, any JSON object, a regular
expression, one of several strings, or a context-free grammar. A plain value type that
travels with the sampling parameters (Ray messages, the Redis record); the matcher that
enforces it lives in `grammar.py`, rebuilt wherever the request runs from the tokens it
already emitted."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

# A constraint's text (schema, regex or grammar) and its choices are bounded: it is parsed on
# the router and on every worker that runs the request.
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema, as JSON
    JSON_OBJECT = "json_object"  # any JSON object; text unused
    REGEX = "regex"  # text: the pattern, matched whole (Rust regex syntax)
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # text: Lark, or GBNF (llama.cpp's EBNF) when it uses `::=`


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise ValueError(f"constraint.kind={self.kind!r}: use one of {kinds}") from None
        object.__setattr__(self, "choices", tuple(self.choices))
        self.validate()

    def validate(self) -> None:
        kind = self.kind.value
        if not isinstance(self.text, str) or any(not isinstance(c, str) for c in self.choices):
            raise ValueError(f"constraint.{kind}: must be text")
        size = len(self.text.encode("utf-8", "surrogatepass")) + sum(
            len(c.encode("utf-8", "surrogatepass")) for c in self.choices
        )
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"constraint.{kind}: {size} bytes, at most {MAX_CONSTRAINT_BYTES} "
                "(max_constraint_bytes)"
            )
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                raise ValueError("constraint.choice: give at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(
                    f"constraint.choice: {len(self.choices)} strings, at most {MAX_CHOICES}"
                )
            if any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choices):
                raise ValueError(
                    f"constraint.choice: each string non-empty, at most {MAX_CHOICE_CHARS} "
                    "characters"
                )
        elif self.kind is not ConstraintKind.JSON_OBJECT and not self.text.strip():
            raise ValueError(f"constraint.{kind}: is empty")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except ValueError as e:
                raise ValueError(f"constraint.json_schema: not JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("constraint.json_schema: a schema is a JSON object")

    @classmethod
    def of(cls, value: Constraint | dict | None) -> Constraint | None:
        """From itself or its dict (a record read back from JSON)."""
        if value is None or isinstance(value, Constraint):
            return value
        return cls(**value)

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(ConstraintKind.JSON_SCHEMA, text)
