"""TFDS catalog translation datasets (e.g. ``wmt14_translate/de-en``) as source/target pairs.

Preparing a catalog dataset needs network access and TensorFlow; reading prepared
``array_record`` data does not. See :mod:`flaxformer_lite.data.translation` for the loaders
of local corpora.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds


class CatalogError(ValueError):
    """A TFDS catalog dataset cannot be found, downloaded, prepared or read as pairs."""


class CatalogPairs:
    """Random-access view of a catalog translation split as ``{"source", "target"}`` records.

    Catalog datasets key their text by language code (``{"de": ..., "en": ...}``); this renames
    ``source_lang`` to "source" and ``target_lang`` to "target" and drops other fields.
    """

    def __init__(self, records: Sequence[Mapping[str, Any]], source_lang: str, target_lang: str):
        self._records = records
        self._langs = (source_lang, target_lang)

    def __len__(self) -> int:
        return len(self._records)

    def _rename(self, record: Mapping[str, Any]) -> dict[str, Any]:
        return {"source": record[self._langs[0]], "target": record[self._langs[1]]}

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Returns record ``index`` as ``{"source": bytes, "target": bytes}``."""
        return self._rename(self._records[index])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Returns the records at ``indices``, read in one batch when the source supports it."""
        read_batch = getattr(type(self._records), "__getitems__", None)  # as in `read_all`
        records = (
            read_batch(self._records, indices)
            if read_batch
            else [self._records[i] for i in indices]
        )
        return [self._rename(record) for record in records]


def _require_tensorflow(name: str) -> None:
    """Raises CatalogError unless TensorFlow, which catalog builders prepare with, imports."""
    try:
        importlib.import_module("tensorflow")
    except ImportError as e:
        raise CatalogError(
            f"Preparing the TFDS catalog dataset {name!r} needs TensorFlow (TFDS extracts and "
            "serializes catalog data with it), which is not installed. Install it with "
            '`pip install -e ".[tf]"`, or use load_parallel_text / load_tsv_pairs for local files'
        ) from e


def load_catalog(
    name: str,
    *,
    source_lang: str,
    target_lang: str,
    tfds_dir: str | os.PathLike,
    splits: Sequence[str] | None = None,
    download: bool = True,
) -> dict[str, CatalogPairs]:
    """Opens a TFDS catalog translation dataset, downloading and preparing it if needed.

    Args:
        name: catalog name and config, e.g. ``"wmt14_translate/de-en"``.
        source_lang: feature (language code) used as "source", e.g. ``"de"``.
        target_lang: feature used as "target", e.g. ``"en"``.
        tfds_dir: TFDS data directory to look up and prepare the dataset in.
        splits: splits to open (TFDS slices such as ``"train[:1%]"`` work); default: all.
        download: download and prepare (as ``array_record``) when not prepared yet.

    Returns:
        ``{split: CatalogPairs}``: random-access sequences of ``{"source": bytes,
        "target": bytes}``.
    """
    tfds.disable_progress_bar()
    builder = _open_builder(name, tfds_dir)
    _check_languages(builder, name, (source_lang, target_lang))
    if not builder.is_prepared():
        _prepare(builder, name, tfds_dir, download)
    records = _open_splits(builder, name, splits)
    return {split: CatalogPairs(data, source_lang, target_lang) for split, data in records.items()}


def _open_builder(name: str, tfds_dir: str | os.PathLike) -> tfds.core.DatasetBuilder:
    """The catalog builder ``name`` (``dataset/config``) in ``tfds_dir``; CatalogError if none."""
    # TFDS imports its legacy builder packages in one loop that stops at the first ImportError
    # (e.g. h5py missing), so the translation builders may never be registered; importing
    # their package registers them. If that fails too, `tfds.builder` reports "not found".
    with contextlib.suppress(ImportError):
        importlib.import_module("tensorflow_datasets.translate")
    try:
        return tfds.builder(name, data_dir=os.fspath(tfds_dir))
    except ValueError as e:  # Includes DatasetNotFoundError and unknown configs.
        raise CatalogError(
            f"No TFDS catalog dataset {name!r} ({str(e).splitlines()[0]}). Pass a name such as "
            "'wmt14_translate/de-en' (see https://www.tensorflow.org/datasets/catalog)"
        ) from e


def _check_languages(builder: Any, name: str, langs: Sequence[str]) -> None:
    """Raises CatalogError unless every one of ``langs`` is a feature of the dataset."""
    features = builder.info.features
    available = sorted(features.keys()) if hasattr(features, "keys") else []
    for lang in langs:
        if lang not in available:
            raise CatalogError(
                f"{name} has no feature {lang!r}; its features are {available}. Pass "
                "source_lang and target_lang from these"
            )


def _prepare(builder: Any, name: str, tfds_dir: str | os.PathLike, download: bool) -> None:
    """Downloads and prepares the dataset as ``array_record``, if ``download`` allows it."""
    if not download:
        raise CatalogError(
            f"{name} is not prepared in {tfds_dir}; pass download=True (needs network access "
            "and TensorFlow) or a tfds_dir where it is prepared"
        )
    _require_tensorflow(name)
    try:
        builder.download_and_prepare(file_format="array_record")
    except (tfds.download.DownloadError, OSError) as e:  # requests errors are OSErrors.
        raise CatalogError(
            f"{name} could not be downloaded and prepared ({type(e).__name__}: {e}). "
            "Without network access, use load_parallel_text for line-aligned "
            "{split}.{lang} files or load_tsv_pairs for a tab-separated file of pairs"
        ) from e


def _open_splits(builder: Any, name: str, splits: Sequence[str] | None) -> dict[str, Any]:
    """``{split: random-access records}`` of ``splits`` (default: all) of a prepared dataset."""
    if isinstance(splits, str):
        raise TypeError(f"splits must be a sequence of names, not the string {splits!r}")
    splits = tuple(builder.info.splits if splits is None else splits)
    if not splits:
        raise CatalogError(f"{name} lists no splits in {builder.data_dir}; pass splits=")
    try:
        return {split: builder.as_data_source(split=split) for split in splits}
    except NotImplementedError as e:  # What TFDS raises for files without random access.
        fmt = builder.info.file_format
        raise CatalogError(
            f"{name} is prepared in {builder.data_dir} as {getattr(fmt, 'value', fmt)} files, "
            "which cannot be read by random access. Prepare it again with "
            "download_and_prepare(file_format='array_record') in another tfds_dir (or delete "
            "that directory and call load_catalog again)"
        ) from e
