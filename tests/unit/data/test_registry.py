"""The dataset registry (datasets.py): each entry's options section, fields, check and loader."""

import dataclasses

import pytest

from flaxformer_lite import datasets
from flaxformer_lite.config import ConfigError
from flaxformer_lite.config.dataset_options import (
    Names,
    NumberWords,
    ParallelText,
    SpokenNumbers,
    Tsv,
)
from flaxformer_lite.config.sections import DataConfig

FIELDS = {f.name: f for f in dataclasses.fields(DataConfig)}
NESTED = {name for name, f in FIELDS.items() if "section" in f.metadata}


@pytest.mark.parametrize("name", [*datasets.DATASETS, "wmt14_translate/de-en"])
def test_every_entry_reads_shared_data_fields_that_exist(name):
    entry = datasets.entry(DataConfig(dataset=name))
    assert set(entry.fields) <= set(FIELDS) - NESTED
    assert len(set(entry.fields)) == len(entry.fields)


def test_each_options_section_is_nested_in_data_under_its_datasets_name():
    with_options = {n: e.options for n, e in datasets.DATASETS.items() if e.options}
    assert set(with_options) == NESTED
    for name, options in with_options.items():
        assert FIELDS[name].metadata["section"] is options
    assert datasets.CATALOG.options is None


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
        ({"number_words": NumberWords(languages=("en", "xx"))}, "languages has 'xx'"),
        ({"number_words": NumberWords(max_number=50)}, "always_train_below=100 keeps every"),
        ({"valid_fraction": 0.5, "test_fraction": 0.5}, "leave no training examples"),
        ({"dataset": "tsv"}, "data.tsv.path is empty"),
        ({"dataset": "tsv", "tsv": Tsv(path="p", target_column=0)}, "different columns"),
        ({"dataset": "parallel_text"}, "data.parallel_text.corpus_dir is empty"),
        (
            {"dataset": "parallel_text", "parallel_text": ParallelText(corpus_dir="c")},
            "data.source_lang is empty",
        ),
        ({"dataset": "some/catalog", "source_lang": "en", "target_lang": "en"}, "both 'en'"),
        (
            {"dataset": "spoken_numbers", "spoken_numbers": SpokenNumbers(languages=("en", "en"))},
            "distinct",
        ),
        (
            {"dataset": "spoken_numbers", "spoken_numbers": SpokenNumbers(numbers=5000)},
            "data.spoken_numbers.numbers=5000",
        ),
    ],
)
def test_each_entry_checks_the_fields_it_reads(fields, words):
    with pytest.raises(ConfigError, match=words):
        datasets.check(DataConfig(**fields))


def test_an_options_section_checks_its_own_fields():
    with pytest.raises(ConfigError, match="data.names.train must be a positive integer, got 0"):
        Names(train=0)
    with pytest.raises(ConfigError, match="data.spoken_numbers.target='letters' is not one of"):
        SpokenNumbers(target="letters")


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
        options = dataclasses.fields(entry.options) if entry.options else ()
        own = [f"{name}.{f.name}" for f in options]
        assert re.findall(r"`([\w.]+)`", listed[name]) == own + list(entry.fields), name
