"""Run configs (ml_collections, `configs/*.py`) -> validated library objects.

A run config has four sections: `model` (fields of `TransformerConfig`),
`data`, `optim` and `train`. This module checks them, builds the model config
and the dataset splits, and produces the JSON-friendly view saved in a workdir.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import ml_collections

from flaxformer_lite.config import SHAPE_FIELDS as MODEL_SHAPE_FIELDS
from flaxformer_lite.config import ConfigError, TransformerConfig, from_mapping

# What must agree for a checkpoint in a workdir to be resumed.
SHAPE_FIELDS = MODEL_SHAPE_FIELDS


def model_config(
    config: ml_collections.ConfigDict,
    vocab_size: int | None = None,
    target_vocab_size: int | None = None,
    **overrides,
) -> TransformerConfig:
    """The model config of a run.

    `vocab_size` and `target_vocab_size` (from the trained vocabularies; the
    latter None when one vocabulary is shared) override the config's.
    """
    values = dict(config.model.to_dict())
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
        values["target_vocab_size"] = target_vocab_size
    values.update(overrides)
    return from_mapping(values)


def planned_model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
    """The model a run will build before its vocabularies exist: the vocabulary sizes are
    the ones asked for in `data` (SentencePiece may return fewer pieces for small data)."""
    d = config.data
    target = d.get("target_vocab_size", 0) if not d.get("shared_vocab", True) else 0
    return model_config(config, d.vocab_size, target or None)


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks what can be checked before any data is read. Raises ConfigError."""
    for section in ("model", "data", "optim", "train"):
        if section not in config:
            raise ConfigError(
                f"run config has no '{section}' section; start from configs/default.py"
            )
    model_config(config)  # field names, types and consistency
    for name, value in (config.get("mesh") or {}).items():
        if name not in ("fsdp", "model"):
            raise ConfigError(f"mesh.{name} is not a mesh field; the fields are fsdp and model")
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"mesh.{name} must be a positive integer, got {value!r}")
    t, d = config.train, config.data
    for name in ("batch_size", "eval_batch_size", "num_steps", "log_every"):
        value = t[name]
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
    accum = t.get("grad_accum_steps", 1)
    if not isinstance(accum, int) or accum < 1 or t.batch_size % accum:
        raise ConfigError(
            f"train.grad_accum_steps={accum!r} must be a positive integer dividing "
            f"train.batch_size={t.batch_size}"
        )
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing!r}")
    for name in ("max_source_len", "max_target_len", "vocab_size"):
        if not isinstance(d[name], int) or d[name] < 2:
            raise ConfigError(f"data.{name} must be an integer >= 2, got {d[name]!r}")
    shared = d.get("shared_vocab", True)
    target_size = d.get("target_vocab_size", 0)
    if not isinstance(target_size, int) or target_size < 0 or target_size == 1:
        raise ConfigError(
            f"data.target_vocab_size must be 0 (same as data.vocab_size) or an integer >= 2, "
            f"got {target_size!r}"
        )
    if shared and target_size not in (0, d.vocab_size):
        raise ConfigError(
            f"data.target_vocab_size={target_size} needs separate vocabularies: set "
            "--config.data.shared_vocab=False (and --config.model.share_embeddings=False)"
        )
    if not shared and config.model.share_embeddings:
        raise ConfigError(
            "data.shared_vocab=False gives the source and the target their own vocabularies, "
            "which cannot share one embedding table: set --config.model.share_embeddings=False"
        )


def load_splits(data: ml_collections.ConfigDict) -> dict[str, Any]:
    """Dataset splits as random-access sources of {"source": bytes, "target": bytes}.

    Keys: "train", "validation" and, when the dataset has one, "test".
    data.dataset selects the loader:
      number_words    the generated default task;
      parallel_text   {split}.{lang} files in data.corpus_dir, split names mapped
                      by data.split_names (e.g. {"validation": "val"});
      tsv             a tab-separated pairs file data.tsv_path, seeded split;
      anything else   a TFDS catalog name such as "wmt14_translate/de-en".
    """
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    try:
        # TFDS announces preparation on stdout; keep stdout for results.
        with contextlib.redirect_stdout(sys.stderr):
            return _load(data, log)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from e


def _renamed(splits: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Maps the library's split names (train/validation/test) to a corpus's own names."""
    out = {}
    for ours in ("train", "validation", "test"):
        theirs = names.get(ours, ours)
        if theirs in splits:
            out[ours] = splits[theirs]
    if "train" not in out or "validation" not in out:
        raise ConfigError(
            f"the corpus has splits {sorted(splits)}, but training needs a train and a "
            "validation split; map them with data.split_names, e.g. "
            "--config.data.split_names=\"{'validation': 'val'}\""
        )
    return out


def _load(data: ml_collections.ConfigDict, log) -> dict[str, Any]:
    if data.dataset == "number_words":
        from flaxformer_lite.data.numbers import load_number_words

        return load_number_words(
            tfds_dir(data),
            tuple(data.languages),
            data.max_number,
            data.seed,
            data.valid_fraction,
            data.test_fraction,
        )
    from flaxformer_lite.data import translation

    names = dict(data.get("split_names", None) or {})
    if data.dataset == "parallel_text":
        corpus = os.path.abspath(data.corpus_dir)
        if not os.path.isdir(corpus):
            raise ConfigError(
                f"data.corpus_dir={data.corpus_dir!r} is not a directory; point it at a "
                "folder of {split}.{lang} files"
            )
        wanted = [names.get(s, s) for s in ("train", "validation", "test")]
        present = [
            s
            for s in wanted
            if any(
                os.path.exists(os.path.join(corpus, f"{s}.{data.source_lang}{gz}"))
                for gz in ("", ".gz")
            )
        ]
        splits = translation.load_parallel_text(
            corpus,
            data.source_lang,
            data.target_lang,
            tfds_dir=tfds_dir(data),
            splits=present,
            log=log,
        )
        return _renamed(splits, names)
    if data.dataset == "tsv":
        splits = translation.load_tsv_pairs(
            data.tsv_path,
            tfds_dir=tfds_dir(data),
            source_column=data.source_column,
            target_column=data.target_column,
            seed=data.seed,
            valid_fraction=data.valid_fraction,
            test_fraction=data.test_fraction,
            log=log,
        )
        return _renamed(splits, names)
    splits = translation.load_catalog(
        data.dataset,
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        tfds_dir=tfds_dir(data),
    )
    return _renamed(splits, names)


def tfds_dir(data: ml_collections.ConfigDict) -> str:
    """Where TFDS datasets are prepared: data.tfds_dir, else $TFDS_DATA_DIR, else TFDS's default."""
    return (
        data.tfds_dir
        or os.environ.get("TFDS_DATA_DIR")
        or os.path.expanduser("~/tensorflow_datasets")
    )


def to_saved_dict(config: ml_collections.ConfigDict, model: TransformerConfig) -> dict[str, Any]:
    """JSON-friendly run config with the resolved model config (as saved in a workdir)."""
    out = config.to_dict()
    out["model"] = model.to_dict()
    return _jsonable(out)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
