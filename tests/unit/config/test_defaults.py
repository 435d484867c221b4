"""config/defaults.py: the base run config is the dataclasses' defaults, typed for flags."""

import ast
import dataclasses
import inspect

import pytest
from absl import flags
from ml_collections import config_flags

from configs import default
from flaxformer_lite.config import defaults
from flaxformer_lite.config.model import TransformerConfig
from flaxformer_lite.config.run import RunConfig, parse
from flaxformer_lite.config.variants import NATConfig


def test_the_base_config_parses_to_the_dataclass_defaults():
    config = defaults.base_config()
    assert set(config) == set(defaults.BASE_SECTIONS)
    run = parse(config)
    default_model = TransformerConfig()
    # parse gives the model the vocabulary sizes asked for in `data`
    model = default_model.replace(vocab_size=run.data.vocab_size)
    assert run == RunConfig(model=model, auto_dtype=False)
    assert config.model.to_dict() == default_model.to_dict()


def test_every_field_of_a_base_section_is_in_the_base_config():
    config = defaults.base_config()
    for f in dataclasses.fields(RunConfig):
        if f.name in defaults.BASE_SECTIONS:
            section = getattr(parse(config), f.name)
            assert set(config[f.name]) == {g.name for g in dataclasses.fields(section)}, f.name
    assert set(config.data.tsv) == {"path", "source_column", "target_column"}


def test_configs_default_sets_only_what_differs_from_the_dataclasses():
    """Every assignment in configs/default.py changes a value: a default is said once."""
    base = defaults.base_config()
    source = inspect.getsource(default)
    assigned = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    assigned.add(target.attr)
    config = default.get_config()
    assert assigned
    for name in assigned:
        assert config.model[name] != base.model[name], name
    for section in defaults.BASE_SECTIONS[1:]:
        assert config[section].to_dict() == base[section].to_dict(), section


def test_section_config_sets_values_over_the_defaults():
    nat = defaults.section_config("nat", iterations=3)
    assert parse_nat(nat) == NATConfig(iterations=3)
    with pytest.raises(KeyError, match="nat.iteration is not a nat field"):
        defaults.section_config("nat", iteration=3)
    with pytest.raises(KeyError, match="'decoder' is not a run-config section"):
        defaults.section_config("decoder")


def parse_nat(values):
    from flaxformer_lite.config.variants import nat_of

    return nat_of({"nat": values})


def _parse_flags(argv):
    """`argv`'s --config.* flags applied to configs/default.py, as train.py does."""
    values, argv = flags.FlagValues(), ["train.py", *argv]
    path = inspect.getsourcefile(default)
    config_flags.DEFINE_config_file(
        "config", path, flag_values=values, lock_config=True, sys_argv=argv
    )
    values(argv)
    return values.config


def test_flags_set_fields_of_every_kind():
    config = _parse_flags(
        [
            "--config.model.d_kv=32",
            "--config.model.target_vocab_size=300",
            "--config.data.tsv.path=pairs.tsv",
            "--config.data.spoken_numbers.languages=('en', 'de')",
            "--config.data.split_names={'validation': 'dev'}",
            "--config.train.hang_factor=3",
        ]
    )
    assert config.model.d_kv == 32 and config.model.target_vocab_size == 300
    assert config.data.tsv.path == "pairs.tsv"
    assert config.data.spoken_numbers.languages == ("en", "de")
    assert config.data.split_names.to_dict() == {"validation": "dev"}
    assert config.train.hang_factor == 3.0 and isinstance(config.train.hang_factor, float)
    assert _parse_flags([]).model.d_kv is None
