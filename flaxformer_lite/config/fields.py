"""The field machinery of the run-config sections (sections.py, variants.py).

A section is a frozen dataclass whose every field is made by `field(default, check)`.
A `Check` is a function (flag, value) -> an error line, or None when the value is fine;
the flag is the field's full name, e.g. "train.batch_size". `section(cls, name, values)`
builds the dataclass from a config's section: it refuses names that are not fields,
gives missing fields their defaults, turns integers into floats for float fields, runs
each field's check in field order and raises `ConfigError` with the first error line.
A field made by `subsection(cls)` holds a section nested in another (`data.tsv`), built
the same way from its own values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from flaxformer_lite.config.errors import ConfigError

SPLITS = ("train", "validation", "test")

# Checks: (flag, value) -> an error line, or None when the value is fine.
Check = Callable[[str, Any], "str | None"]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_at_least(low: int) -> Check:
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
    return lambda flag, v: None if is_int(v) and v >= low else f"{flag} must be {what}, got {v!r}"


def number(low: float, high: float | None = None, *, low_open=False, high_open=True) -> Check:
    lo, hi = "(" if low_open else "[", ")" if high_open else "]"
    interval = f"{lo}{low:g}, {'inf' if high is None else f'{high:g}'}{hi}"

    def check(flag, v):
        ok = is_number(v) and (v > low if low_open else v >= low)
        if ok and high is not None:
            ok = v < high if high_open else v <= high
        return None if ok else f"{flag} must be a number in {interval}, got {v!r}"

    return check


def one_of(*choices: str) -> Check:
    return lambda flag, v: (
        None if v in choices else f"{flag}={v!r} is not one of {', '.join(choices)}"
    )


def boolean(flag, v):
    return None if isinstance(v, bool) else f"{flag} must be True or False, got {v!r}"


def string(flag, v):
    return None if isinstance(v, str) else f"{flag} must be a string, got {v!r}"


def strings(flag, v):
    if isinstance(v, (tuple, list)) and v and all(isinstance(s, str) and s for s in v):
        return None
    return f"{flag} must be a non-empty tuple of strings, e.g. ('en', 'de'), got {v!r}"


def split_name_map(flag, v):
    if not isinstance(v, Mapping) or not all(isinstance(s, str) for s in v.values()):
        return f"{flag} must map split names to the corpus's own, got {v!r}"
    unknown = sorted(set(v) - set(SPLITS))
    if unknown:
        return f"{flag} has key {unknown[0]!r}; its keys are {', '.join(SPLITS)}"
    return None


def head_indices(flag, v):
    if isinstance(v, (tuple, list)) and all(is_int(h) and h >= 0 for h in v):
        return None
    return f"{flag} must be a tuple of head indices >= 0 (empty: all heads), got {v!r}"


POSITIVE, NON_NEGATIVE, FRACTION = int_at_least(1), int_at_least(0), number(0.0, 1.0)


def field(default, check: Check, default_factory=None):
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


def subsection(cls):
    """A field holding section `cls` nested in this one (e.g. `data.tsv`), its defaults
    when a config leaves it out."""

    def check(flag, v):
        return None if isinstance(v, cls) else f"{flag} must be a section of fields, got {v!r}"

    return dataclasses.field(default_factory=cls, metadata={"check": check, "section": cls})


def plain(value):
    """ConfigDict values as plain Python: nested dicts, lists as tuples."""
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value


def check_fields(obj, name: str) -> None:
    """Runs every field's check on a built section (its `__post_init__`), so that a section
    made in code is held to the same rules as one read from a run config.

    Raises:
      ConfigError: the first field whose check fails, named `{name}.{field}`.
    """
    for f in dataclasses.fields(obj):
        message = f.metadata["check"](f"{name}.{f.name}", getattr(obj, f.name))
        if message:
            raise ConfigError(message)


def section(cls, name: str, values: Mapping[str, Any]):
    """Builds dataclass `cls` from `values`, checking every field; missing ones take defaults."""
    fields = dataclasses.fields(cls)
    unknown = sorted(set(values) - {f.name for f in fields})
    if unknown:
        raise ConfigError(
            f"{name}.{unknown[0]} is not a {name} field; the fields are "
            + ", ".join(f.name for f in fields)
        )
    kwargs = {}
    for f in fields:
        if "section" in f.metadata:
            kwargs[f.name] = _nested(f.metadata["section"], f"{name}.{f.name}", values, f.name)
            continue
        if f.name in values:
            value = plain(values[f.name])
        else:
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if is_int(value) and f.type == "float":
            value = float(value)
        message = f.metadata["check"](f"{name}.{f.name}", value)
        if message:
            raise ConfigError(message)
        kwargs[f.name] = value
    return cls(**kwargs)


def _nested(cls, flag: str, values: Mapping[str, Any], name: str):
    """The section nested under `name` in `values`, built by `section`."""
    nested = values.get(name, None)
    if nested is None:
        nested = {}
    if isinstance(nested, cls):
        return nested
    if not isinstance(nested, (ml_collections.ConfigDict, Mapping)):
        raise ConfigError(
            f"{flag} is a section of fields, got {nested!r}; set one of them, e.g. "
            f"--config.{flag}.{dataclasses.fields(cls)[0].name}=..."
        )
    return section(cls, flag, nested)
