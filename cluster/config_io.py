"""Reading a tree of frozen config dataclasses from a YAML/TOML file and from command-line
flags, both generated from the dataclass fields themselves, so that a field cannot exist in
one place and be missing from the other.

- File: a nested mapping, one key per field, one sub-mapping per nested config.
- Flags: one per leaf field, `--<section>-<field>` with dashes (`--redis-url`), except in
  sections marked flat (`--block-size` for `engine.block_size`). Booleans get `--x/--no-x`.
  A field may add aliases in its metadata; `{section}` in one is its section's name
  (`"--{section}"` makes `--prefill` an alias of `--prefill-replicas`).
- Errors name the field by its path (`engine.block_size`), whichever source it came from.

Field metadata understood here: `help`, `choices`, `aliases`. A field typed as an Enum takes
its members' values, and those are its choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]  # ("engine", "block_size")
    field: dataclasses.Field
    kind: Any  # the resolved type: int, float, str, bool, dict, possibly `| None`

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)

    @property
    def optional(self) -> bool:
        return _is_optional(self.kind)

    @property
    def base(self) -> Any:
        return _base(self.kind)


def _is_optional(kind) -> bool:
    return isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)


def _base(kind):
    if _is_optional(kind):
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    return typing.get_origin(kind) or kind


def _is_config(kind) -> bool:
    return dataclasses.is_dataclass(kind) and isinstance(kind, type)


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every settable field of the tree rooted at `cls`, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if _is_config(kind):
            yield from leaves(kind, (*prefix, f.name))
        else:
            yield Leaf((*prefix, f.name), f, kind)


def flag_names(leaf: Leaf, flat: frozenset[str]) -> list[str]:
    parts = [p for p in leaf.path[:-1] if p not in flat]
    main = "--" + "-".join([*parts, leaf.path[-1]]).replace("_", "-")
    section = leaf.path[-2] if len(leaf.path) > 1 else ""
    aliases = [a.format(section=section) for a in leaf.field.metadata.get("aliases", ())]
    return [main, *aliases]


def add_flags(parser: argparse.ArgumentParser, cls: type, flat=frozenset(), title=None) -> None:
    """One flag per leaf field of `cls`; unset flags stay out of the parsed namespace."""
    group = parser.add_argument_group(title or cls.__name__)
    for leaf in leaves(cls):
        names = flag_names(leaf, frozenset(flat))
        meta = leaf.field.metadata
        default = _default(leaf.field)
        help_text = meta.get("help", "")
        if default is not None and default != {}:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {
            "dest": leaf.dest,
            "default": argparse.SUPPRESS,
            "help": help_text,
        }
        if leaf.base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = leaf.path[-1].upper()
            if "choices" in meta or _is_enum(leaf.base):
                kwargs["choices"] = choices(leaf)
        group.add_argument(*names, **kwargs)


def _is_enum(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def choices(leaf: Leaf) -> list | None:
    """The values a field takes, when they are a closed set: an Enum's, or its `choices`."""
    if _is_enum(leaf.base):
        return [m.value for m in leaf.base]
    return leaf.field.metadata.get("choices")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def overrides_from_args(cls: type, args: argparse.Namespace) -> dict:
    """The flags the user actually gave, as a nested mapping like the file's."""
    out: dict = {}
    for leaf in leaves(cls):
        if hasattr(args, leaf.dest):
            node = out
            for p in leaf.path[:-1]:
                node = node.setdefault(p, {})
            node[leaf.path[-1]] = getattr(args, leaf.dest)
    return out


def read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    text = p.read_text()
    try:
        values = tomllib.loads(text) if p.suffix == ".toml" else (yaml.safe_load(text) or {})
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: cannot parse ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{p}: expected a mapping of config fields")
    return values


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build(cls: type, values: dict, where: str = "config", prefix: tuple[str, ...] = ()):
    """The config tree from a nested mapping; every error names the field's path."""
    if not isinstance(values, dict):
        name = ".".join(prefix) or "the config"
        raise ConfigError(f"{where}: {name} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        names = ", ".join(".".join((*prefix, u)) for u in unknown)
        raise ConfigError(f"{where}: unknown config field(s) {names}")
    kwargs = {}
    for name, value in values.items():
        path = (*prefix, name)
        kind = hints[name]
        if _is_config(kind):
            kwargs[name] = build(kind, value, where, path)
        else:
            kwargs[name] = _convert(Leaf(path, fields[name], kind), value, where)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        section = ".".join(prefix)
        raise ConfigError(f"{where}: {section + ': ' if section else ''}{e}") from None


def _convert(leaf: Leaf, value, where: str):
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{where}: {leaf.name}={value!r}: {why}")

    named = isinstance(value, str) and value in (choices(leaf) or ())  # quantization: none
    if value is None or (
        isinstance(value, str) and value.lower() in ("none", "null") and not named
    ):
        if leaf.optional:
            return None
        raise bad("a value is required")
    base = leaf.base
    try:
        if base is bool:
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
                return value.lower() in ("true", "yes", "1")
            if not isinstance(value, bool):
                raise bad("expected true or false")
        elif base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise bad("expected an integer")
            value = int(value)
        elif base is float:
            if isinstance(value, bool):
                raise bad("expected a number")
            value = float(value)
        elif base is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise bad("expected a string")
            value = str(value)
        elif base is dict:
            value = _mapping(value)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise bad(f"expected {getattr(base, '__name__', base)}") from None
    allowed = choices(leaf)
    if allowed is not None and value not in allowed:
        raise bad(f"choose from {', '.join(map(str, allowed))}")
    return base(value) if _is_enum(base) else value


def _mapping(value) -> dict:
    """A mapping of name to number, from the file or as `a=1,b=2` from a flag."""
    if isinstance(value, str):
        pairs = [p for p in value.split(",") if p.strip()]
        value = {}
        for p in pairs:
            k, sep, v = p.partition("=")
            if not sep:
                raise ValueError(p)
            value[k.strip()] = float(v)
    if not isinstance(value, dict):
        raise ValueError(value)
    return {str(k): float(v) for k, v in value.items()}


def load(cls: type, path: str | Path | None, overrides: dict | None = None):
    """File values first, then the overrides (from flags); validated once."""
    values = read_file(path) if path else {}
    where = str(path) if path else "flags"
    if overrides:
        values = merge(values, overrides)
        where = f"{path} + flags" if path else "flags"
    return build(cls, values, where)


def to_mapping(cfg) -> dict:
    """The inverse of `build`: a nested mapping of every field (for storing a config)."""
    return dataclasses.asdict(cfg)
