"""Run configs made from the section dataclasses: the defaults are declared there, once.

`base_config()` is what configs/default.py starts from: a ConfigDict with every field of
the base sections at its dataclass default. `section_config(name, **values)` is one
section, for the variant sections a config adds. The values keep their types, so that
`--config.section.field=value` flags parse as the field's type; a field whose default is
None (model.d_kv) holds a typed placeholder, so `--config.model.d_kv=32` parses as an int.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from flaxformer_lite.config.model import TransformerConfig
from flaxformer_lite.config.run import RunConfig

# The sections every run config starts with. The variant sections nat and copy switch
# their model on by being there, and guided_attention is added by the configs that use it.
BASE_SECTIONS = ("model", "data", "optim", "mesh", "train", "scheduled_sampling")


def base_config() -> ml_collections.ConfigDict:
    """The base sections, every field at its dataclass default."""
    config = ml_collections.ConfigDict()
    for name in BASE_SECTIONS:
        config[name] = section_config(name)
    return config


def section_config(name: str, **values: Any) -> ml_collections.ConfigDict:
    """Section `name` of a run config: its dataclass defaults, with `values` set over them.

    Raises:
      KeyError: `name` is not a section, or `values` names a field it lacks.
    """
    cls = _section_class(name)
    defaults = _defaults(cls)
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise KeyError(f"{name}.{unknown[0]} is not a {name} field")
    return _config_dict(cls, {**defaults, **values})


def _section_class(name: str) -> type:
    """The dataclass of run-config section `name`, as RunConfig declares it."""
    if name not in RunConfig.__dataclass_fields__ or name == "auto_dtype":
        raise KeyError(f"{name!r} is not a run-config section")
    return _not_none(typing.get_type_hints(RunConfig)[name])


def _defaults(cls: type) -> dict[str, Any]:
    if cls is TransformerConfig:
        return TransformerConfig().to_dict()  # the dtypes by name, as a run config gives them
    return dataclasses.asdict(cls())


def _config_dict(cls: type, values: dict[str, Any]) -> ml_collections.ConfigDict:
    hints = typing.get_type_hints(cls)
    out = ml_collections.ConfigDict()
    for name, value in values.items():
        if dataclasses.is_dataclass(hints[name]):  # a nested section such as data.tsv
            value = _config_dict(hints[name], value)
        elif value is None:
            value = config_dict.placeholder(_not_none(hints[name]))
        out[name] = value
    return out


def _not_none(hint) -> type:
    """`X` of an optional `X | None` annotation (else the annotation itself)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(hint) else hint
