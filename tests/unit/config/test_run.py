"""RunConfig (config/run.py): parsed once, written to a workdir and read back equal."""

import dataclasses
import glob
import importlib.util
import json
import os

import jax.numpy as jnp
import pytest
from conftest import ROOT, tiny_config

from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.run import RunConfig, parse
from flaxformer_lite.config.sections import MOVED_DATA_FIELDS
from flaxformer_lite.config.variants import CopyHead, GuidedAttention, ScheduledSampling
from flaxformer_lite.training import workdir as workdir_lib

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
SAVED = os.path.join(os.path.dirname(__file__), "saved")


def _load(path):
    spec = importlib.util.spec_from_file_location("_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_round_trips_through_json(path):
    run = parse(_load(path))
    written = json.dumps(run.to_json(), sort_keys=True)
    again = RunConfig.from_json(json.loads(written))
    assert again == run
    assert json.dumps(again.to_json(), sort_keys=True) == written
    # Every field of every section is written: a later change of a default cannot change
    # what a saved run meant.
    saved = json.loads(written)
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if dataclasses.is_dataclass(value):
            assert set(saved[f.name]) == {g.name for g in dataclasses.fields(value)}, f.name


@pytest.mark.parametrize("name", ["tiny", "nat", "names_copy", "spoken_numbers"])
def test_a_run_config_saved_by_the_previous_format_reads_as_its_config(name):
    """run_config.json as workdirs wrote it before RunConfig.to_json (the ConfigDict's own
    sections, the model resolved): read back, it is the config that wrote it."""
    with open(os.path.join(SAVED, f"{name}.json")) as f:
        old = json.load(f)
    run = parse(_load(os.path.join(ROOT, "configs", f"{name}.py")))
    assert old != run.to_json()  # another format: sections and fields left out
    assert RunConfig.from_json(old) == run


@pytest.mark.parametrize("name", ["names", "spoken_numbers"])
def test_a_run_config_saved_with_a_flat_data_section_reads_as_its_config(name):
    """run_config.json as RunConfig.to_json wrote it before each dataset had its own section
    in `data` (data.names_train, data.speech_numbers, ...): every flat field is moved into
    its dataset's section, and the run reads back as the config that wrote it."""
    with open(os.path.join(SAVED, "flat_data", f"{name}.json")) as f:
        old = json.load(f)
    run = parse(_load(os.path.join(ROOT, "configs", f"{name}.py")))
    assert set(old["data"]) & set(MOVED_DATA_FIELDS) == set(MOVED_DATA_FIELDS)
    assert RunConfig.from_json(old) == run
    assert old["data"] == _flat(run.to_json()["data"])  # nothing else moved


def _flat(data: dict) -> dict:
    """A `data` section written by to_json, in the flat layout of MOVED_DATA_FIELDS."""
    sections = {new.split(".")[0] for new in MOVED_DATA_FIELDS.values()}
    out = {k: v for k, v in data.items() if k not in sections}
    for old, new in MOVED_DATA_FIELDS.items():
        section, field = new.split(".")
        out[old] = data[section][field]
    return out


def test_a_saved_data_section_with_a_field_in_both_layouts_is_refused():
    saved = parse(tiny_config("/nonexistent")).to_json()
    saved["data"]["max_number"] = 5
    with pytest.raises(ConfigError, match="both data.max_number and data.number_words.max_number"):
        RunConfig.from_json(saved)


def test_the_workdir_reader_migrates_and_the_writer_writes_the_new_format(tmp_path):
    with open(os.path.join(SAVED, "tiny.json")) as f:
        old = json.load(f)
    (tmp_path / workdir_lib.RUN_CONFIG).write_text(json.dumps(old))
    run = workdir_lib.load_run_config(str(tmp_path))
    assert run == parse(_load(os.path.join(ROOT, "configs", "tiny.py")))
    assert run.to_json()["model"] == old["model"]
    workdir_lib.claim_workdir(str(tmp_path / "new"), run, {}, lambda saved: {})
    written = json.loads((tmp_path / "new" / workdir_lib.RUN_CONFIG).read_text())
    assert written == run.to_json() != old


def test_variant_sections_are_the_objects_the_model_takes():
    config = tiny_config("/nonexistent")
    config.guided_attention = {"weight": 2.0, "layers": [-1]}
    run = parse(config)
    assert run.guided_attention == GuidedAttention(weight=2.0, layers=(-1,))
    assert run.scheduled_sampling == ScheduledSampling() and run.copy is None
    # A section made in code is held to the same checks as one read from a config.
    with pytest.raises(ConfigError, match="scheduled_sampling.mode='teacher'"):
        ScheduledSampling(mode="teacher")
    with pytest.raises(ConfigError, match="copy.heads"):
        CopyHead(heads=(-1,))


def test_auto_dtype_is_saved_as_auto_and_resolved_where_it_is_read():
    config = tiny_config("/nonexistent")
    config.model.dtype = "auto"
    run = parse(config)
    assert run.auto_dtype and run.model.dtype == jnp.float32  # a CPU
    saved = run.to_json()
    assert saved["model"]["dtype"] == "auto"
    assert RunConfig.from_json(saved) == run


def test_with_vocab_sets_the_trained_sizes():
    run = parse(tiny_config("/nonexistent"))
    shared = run.with_vocab(37, None)
    assert (shared.model.vocab_size, shared.model.output_vocab_size) == (37, 37)
    assert shared.data == run.data


def test_unknown_saved_sections_and_fields_are_refused():
    saved = parse(tiny_config("/nonexistent")).to_json()
    with pytest.raises(ConfigError, match="unknown section 'decoder'"):
        RunConfig.from_json({**saved, "decoder": {}})
    saved["train"]["steps"] = 3
    with pytest.raises(ConfigError, match="train.steps is not a train field"):
        RunConfig.from_json(saved)
