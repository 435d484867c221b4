"""The dataset registry (datasets.py): each entry's fields, check and loader."""

import dataclasses

import pytest

from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.sections import DataConfig

DATA_FIELDS = {f.name for f in dataclasses.fields(DataConfig)}


@pytest.mark.parametrize("name", [*datasets.DATASETS, "wmt14_translate/de-en"])
def test_every_entry_reads_data_fields_that_exist(name):
    entry = datasets.entry(DataConfig(dataset=name))
    assert set(entry.fields) <= DATA_FIELDS
    assert len(set(entry.fields)) == len(entry.fields)


def test_unknown_names_are_catalog_datasets_and_features_are_speech_only():
    assert datasets.entry(DataConfig(dataset="wmt14_translate/de-en")) is datasets.CATALOG
    speech = {n for n, e in datasets.DATASETS.items() if e.features}
    assert speech == {"spoken_numbers"}
    assert datasets.has_features(DataConfig(dataset="spoken_numbers"))
    assert not datasets.has_features(DataConfig(dataset="parallel_text"))


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"dataset": ""}, "data.dataset is empty"),
        ({"languages": ("en", "xx")}, "data.languages has 'xx'"),
        ({"valid_fraction": 0.5, "test_fraction": 0.5}, "leave no training examples"),
        ({"dataset": "tsv"}, "data.tsv_path is empty"),
        ({"dataset": "tsv", "tsv_path": "p", "target_column": 0}, "different columns"),
        ({"dataset": "parallel_text"}, "data.corpus_dir is empty"),
        ({"dataset": "parallel_text", "corpus_dir": "c"}, "data.source_lang is empty"),
        ({"dataset": "some/catalog", "source_lang": "en", "target_lang": "en"}, "both 'en'"),
        ({"dataset": "spoken_numbers", "speech_languages": ("en", "en")}, "distinct"),
        ({"dataset": "spoken_numbers", "speech_numbers": 5000}, "data.speech_numbers=5000"),
    ],
)
def test_each_entry_checks_the_fields_it_reads(fields, words):
    with pytest.raises(ConfigError, match=words):
        datasets.check(DataConfig(**fields))


def test_the_defaults_and_the_generated_tasks_pass_their_checks():
    for name in ("number_words", "names", "spoken_numbers"):
        datasets.check(DataConfig(dataset=name))


def test_the_tasks_page_lists_each_entry_with_its_fields():
    import pathlib
    import re

    from conftest import ROOT

    page = (pathlib.Path(ROOT) / "docs" / "tasks.md").read_text()
    rows = dict(re.findall(r"^\| (`\w+`|a TFDS catalog name) \| (.*?) \|", page, re.M))
    listed = {name.strip("`"): cells for name, cells in rows.items() if name != "`data.dataset`"}
    entries = {**datasets.DATASETS, "a TFDS catalog name": datasets.CATALOG}
    assert set(listed) == set(entries)
    for name, entry in entries.items():
        assert re.findall(r"`(\w+)`", listed[name]) == list(entry.fields), name
