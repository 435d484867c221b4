"""The TFDS setup shared by the local builders: text pairs stored in generation order, and
preparing a builder once then opening its splits for random access."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import tensorflow_datasets as tfds

SKIPPED_KEY = "skipped_empty_pairs"

Log = Callable[[str], Any]


# `skip_registration` keeps the builders out of TFDS's global name registry: they are only
# constructed directly, and re-importing a module must not raise a name collision.
class PairsBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Features ``{"source": Text, "target": Text}``, stored in generation order.

    Subclasses say what the pairs are (``_description``) and whether their ``DatasetInfo``
    carries metadata saved with the data (``STORES_METADATA``, e.g. skipped-pair counts).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    STORES_METADATA: ClassVar[bool] = False

    def _description(self) -> str:
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        # `dataset_info_from_configs` reads metadata files next to the builder module, which
        # only exist for packaged datasets, so the DatasetInfo is built directly.
        return tfds.core.DatasetInfo(
            builder=self,
            description=self._description(),
            features=tfds.features.FeaturesDict(
                {"source": tfds.features.Text(), "target": tfds.features.Text()}
            ),
            supervised_keys=("source", "target"),
            # Keep generation order (a seeded permutation, or file order) instead of TFDS key
            # hashing.
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict() if self.STORES_METADATA else None,
        )


def prepare(
    builder: tfds.core.DatasetBuilder, splits: Sequence[str], log: Log | None = None
) -> dict[str, Sequence[Any]]:
    """Prepares ``builder`` unless already prepared, logs its split sizes (and skipped pairs),
    and opens ``splits`` without TensorFlow. ``log`` (None: silent) gets progress lines.

    Returns:
        ``{split: source}`` for each of ``splits``: a random-access sequence of records, or an
        empty tuple for a split without examples (TFDS cannot write an empty split).
    """
    log = log or (lambda _: None)
    tfds.disable_progress_bar()
    name = builder.builder_config.name
    if builder.is_prepared():
        log(f"Reusing prepared {name} in {builder.data_dir}")
    else:
        log(f"Preparing {name} in {builder.data_dir}")
        builder.download_and_prepare()
    skipped = dict((builder.info.metadata or {}).items()).get(SKIPPED_KEY, {})
    for split, split_info in builder.info.splits.items():
        log(f"  {split}: {split_info.num_examples} pairs, {skipped.get(split, 0)} skipped (empty)")
    sources = builder.as_data_source()
    return {split: sources.get(split, ()) for split in splits}
