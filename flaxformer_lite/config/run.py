"""Run configs (ml_collections, `configs/*.py`) -> one typed, validated `RunConfig`.

A run config has the sections `model` (fields of `TransformerConfig`, model.py),
`data`, `optim`, `train`, optionally `mesh` (sections.py) and the variant sections
`scheduled_sampling`, `nat`, `copy`, `guided_attention` (variants.py). `parse` turns
one into a `RunConfig` of frozen dataclasses, checking every field and their
consistency before any data is read: each bad value raises `ConfigError` with one
line naming the flag. A field missing from a config takes its dataclass default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from flaxformer_lite import datasets
from flaxformer_lite.config.errors import ConfigError
from flaxformer_lite.config.fields import section
from flaxformer_lite.config.model import TransformerConfig, from_mapping
from flaxformer_lite.config.sections import (
    DataConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
    data_section,
    moved_data_fields,
)
from flaxformer_lite.config.variants import (
    CopyHead,
    GuidedAttention,
    NATConfig,
    ScheduledSampling,
    check_copy,
    check_guided_attention,
    check_nat,
    copy_of,
    guided_attention_of,
    nat_of,
    scheduled_sampling_section,
)

SECTIONS = (
    "model",
    "data",
    "optim",
    "train",
    "mesh",
    "scheduled_sampling",
    "nat",
    "copy",
    "guided_attention",
)


def _default(cls):
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A checked run config: what `configs/*.py` and the flags ask for, or what a workdir
    saved. Before training, `model` has the vocabulary sizes asked for in `data`; once
    the vocabularies exist (and in a workdir), their real sizes (`with_vocab`)."""

    model: TransformerConfig
    data: DataConfig = _default(DataConfig)
    optim: OptimConfig = _default(OptimConfig)
    train: TrainConfig = _default(TrainConfig)
    mesh: MeshConfig = _default(MeshConfig)
    scheduled_sampling: ScheduledSampling = _default(ScheduledSampling)
    nat: NATConfig | None = None  # None: the autoregressive model
    copy: CopyHead | None = None  # None: the plain softmax output
    guided_attention: GuidedAttention = _default(GuidedAttention)
    # model.dtype was "auto": the compute dtype of the platform that reads the config, so
    # a workdir trained on a GPU (bfloat16) decodes on a CPU in float32.
    auto_dtype: bool = False

    def with_vocab(self, source: int, target: int | None) -> RunConfig:
        """The run with the trained vocabularies' sizes (target None: one shared)."""
        model = self.model.replace(vocab_size=source, target_vocab_size=target)
        return dataclasses.replace(self, model=model)

    def to_json(self) -> dict[str, Any]:
        """Every field of every section, JSON-friendly: what a workdir saves
        (`from_json` reads it back equal)."""
        out = {"model": self.model.to_dict()}
        if self.auto_dtype:
            out["model"]["dtype"] = "auto"
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("model", "auto_dtype"):
                out[f.name] = None if value is None else dataclasses.asdict(value)
        return _jsonable(out)

    @classmethod
    def from_json(cls, saved: Mapping[str, Any]) -> RunConfig:
        """A run config as `to_json` wrote it, or as a workdir of an earlier version saved
        it (the ConfigDict's own sections: a missing section or field takes its default,
        which is what that version used; `data` fields of a version before each dataset
        had its own section move into it, `sections.MOVED_DATA_FIELDS`).

        Raises:
          ConfigError: a section or field this version does not know, or a bad value.
        """
        unknown = sorted(set(saved) - set(SECTIONS))
        if unknown:
            raise ConfigError(f"the saved run config has an unknown section {unknown[0]!r}")
        model = dict(saved["model"])
        # Runs saved before the vocabulary was padded stored exactly V rows (`nn/vocab.py`).
        model.setdefault("vocab_multiple", 1)
        return cls(
            model=from_mapping(model),
            data=section(DataConfig, "data", moved_data_fields(saved.get("data") or {})),
            optim=section(OptimConfig, "optim", saved.get("optim") or {}),
            train=section(TrainConfig, "train", saved.get("train") or {}),
            mesh=section(MeshConfig, "mesh", saved.get("mesh") or {}),
            scheduled_sampling=scheduled_sampling_section(saved),
            nat=nat_of(saved),
            copy=copy_of(saved),
            guided_attention=guided_attention_of(saved),
            auto_dtype=model.get("dtype") == "auto",
        )


def parse(config: ml_collections.ConfigDict) -> RunConfig:
    """The typed sections of a run config, every field and their consistency checked.

    Raises:
      ConfigError: one line naming the first bad flag and what it may be.
    """
    for name in ("model", "data", "optim", "train"):
        if name not in config:
            raise ConfigError(f"run config has no '{name}' section; start from configs/default.py")
    extra = sorted(set(config.keys()) - set(SECTIONS))
    if extra:
        raise ConfigError(
            f"run config has a section '{extra[0]}'; the sections are {', '.join(SECTIONS)}"
        )
    share_embeddings = from_mapping(config.model.to_dict()).share_embeddings  # checks the model
    data = data_section(config.data)
    optim = section(OptimConfig, "optim", config.optim)
    train = section(TrainConfig, "train", config.train)
    mesh = section(MeshConfig, "mesh", config.get("mesh", None) or {})
    sampling = scheduled_sampling_section(config)
    datasets.check(data)
    _check_vocabularies(data, share_embeddings)
    target = 0 if data.shared_vocab else data.target_vocab_size
    vocab = {"vocab_size": data.vocab_size, "target_vocab_size": target or None}
    model = from_mapping({**config.model.to_dict(), **vocab})
    _check_together(model, data, optim, train)
    run = RunConfig(
        model=model,
        data=data,
        optim=optim,
        train=train,
        mesh=mesh,
        scheduled_sampling=sampling,
        nat=nat_of(config),
        copy=copy_of(config),
        guided_attention=guided_attention_of(config),
        auto_dtype=config.model.get("dtype") == "auto",
    )
    _check_variants(run)
    return run


def _check_together(model: TransformerConfig, data: DataConfig, optim, train) -> None:
    """The checks that read more than one of the main sections."""
    if data.dataset == "spoken_numbers" and data.batching == "pack":
        raise ConfigError(
            "data.batching=pack puts several token sources in a row; speech features batch "
            "with --config.data.batching=bucket (or fixed)"
        )
    num_mels = data.spoken_numbers.num_mels
    if data.dataset == "spoken_numbers" and model.input_features != num_mels:
        raise ConfigError(
            f"model.input_features={model.input_features} but data.dataset=spoken_numbers gives "
            f"data.spoken_numbers.num_mels={num_mels} features per frame: set "
            f"--config.model.input_features={num_mels}"
        )
    if model.positions == "learned" and max(data.max_source_len, data.max_target_len) > (
        model.max_len
    ):
        raise ConfigError(
            f"model.max_len={model.max_len} is shorter than data.max_source_len="
            f"{data.max_source_len} / data.max_target_len={data.max_target_len}, but learned "
            "positions have one row per position: raise model.max_len"
        )
    if train.batch_size % train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={train.grad_accum_steps} must divide "
            f"train.batch_size={train.batch_size}"
        )
    if train.best_metric in ("bleu", "bleu_tok", "chrf") and not train.eval_bleu:
        raise ConfigError(
            f"train.best_metric={train.best_metric!r} is computed only with "
            "--config.train.eval_bleu=True; set it, or rank checkpoints by loss or exact_match"
        )
    if train.best_metric == "bleu_tok" and not data.target_lang:
        raise ConfigError(
            "train.best_metric='bleu_tok' Moses-tokenizes by the target language, but "
            "data.target_lang is empty: set it (e.g. --config.data.target_lang=de), or rank "
            "checkpoints by bleu"
        )
    if train.early_stop_patience and not train.eval_every:
        raise ConfigError(
            f"train.early_stop_patience={train.early_stop_patience} counts validation "
            "evaluations, but train.eval_every=0 evaluates only at the end: set "
            "--config.train.eval_every"
        )
    if optim.schedule == "rsqrt" and optim.warmup_steps == 0:
        raise ConfigError(
            "optim.warmup_steps=0, but the rsqrt schedule divides by it: use warmup_steps >= 1 "
            "or another optim.schedule"
        )


def _check_variants(run: RunConfig) -> None:
    """The variant sections against the main ones and each other."""
    model, data = run.model, run.data
    if model.subsampling_layers and data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but model.subsampling_layers "
            "convolves across them: use --config.data.batching=bucket or fixed"
        )
    if run.nat is not None and model.subsampling_layers:
        raise ConfigError(
            "model.subsampling_layers is not supported by the nat model (it reads one encoder "
            "position per input frame): set it to 0 or drop the nat section"
        )
    if run.nat is not None:
        check_nat(run.nat, model, data, run.train, run.scheduled_sampling)
    if run.copy is not None:
        check_copy(run.copy, model, data, run.scheduled_sampling, run.nat)
    check_guided_attention(run.guided_attention, model, run.scheduled_sampling, run.nat, run.copy)


def validate(config: ml_collections.ConfigDict, *, platform: bool = True) -> RunConfig:
    """`parse`, and that a kernel forced by `model.attention_impl` exists on this platform.

    `platform=False` leaves the platform's part out and never touches JAX's backends
    (before a multi-process job is joined): a dtype "auto" is then a placeholder, so
    parse again once the job is joined. Raises ConfigError.
    """
    from flaxformer_lite.nn import kernels

    if not platform:
        with kernels.platform_unknown():
            return parse(config)
    run = parse(config)
    kernels.check_platform(run.model.attention_impl)
    return run


def _check_vocabularies(d: DataConfig, share_embeddings: bool) -> None:
    if d.target_vocab_size == 1:
        raise ConfigError(
            "data.target_vocab_size must be 0 (same as data.vocab_size) or an integer >= 2, got 1"
        )
    if d.shared_vocab and d.target_vocab_size not in (0, d.vocab_size):
        raise ConfigError(
            f"data.target_vocab_size={d.target_vocab_size} needs separate vocabularies: set "
            "--config.data.shared_vocab=False (and --config.model.share_embeddings=False)"
        )
    if not d.shared_vocab and share_embeddings:
        raise ConfigError(
            "data.shared_vocab=False gives the source and the target their own vocabularies, "
            "which cannot share one embedding table: set --config.model.share_embeddings=False"
        )


def _jsonable(x):
    if isinstance(x, Mapping):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
