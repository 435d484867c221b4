"""Settings, typed end to end: from `configs/*.py` to the workdir and back.

  errors.py     `ConfigError`, the one error a bad setting raises
  fields.py     how a section's fields declare their checks (`field`, `section`)
  model.py      `TransformerConfig`, the `model` section (modes by `.replace`)
  sections.py   the `data`, `optim`, `train` and `mesh` sections
  dataset_options.py  each dataset's own section, nested in `data` (`data.tsv`, ...)
  variants.py   the optional sections that switch on a model variant
  run.py        `RunConfig`: `parse` a run config once, to and from a workdir's JSON
  defaults.py   the ConfigDict configs/default.py starts from, made from the dataclasses
  reference.py  docs/configuration.md, generated from the dataclasses

`ConfigError` and `TransformerConfig` are importable from here: every layer reads them.
"""

from flaxformer_lite.config.errors import ConfigError
from flaxformer_lite.config.model import TransformerConfig

__all__ = ["ConfigError", "TransformerConfig"]
