"""What `distill.py` does with its flag values: a teacher workdir's distilled corpus.

The decoding and the corpus writing are `flaxformer_lite.translate.distillation`'s; this
module checks the flags, restores the teacher and records where the corpus came from.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data import examples
from flaxformer_lite.translate import distillation, line_io, reports, runner
from flaxformer_lite.translate.distillation import Log, log_stderr


@dataclasses.dataclass(frozen=True)
class Options:
    """The flag values of distill.py (see its flag help for each)."""

    workdir: str
    output_dir: str
    step: str | int | None = "latest"  # a step spec: see training.restore.resolve_step
    beam_size: int = 4
    alpha: float = 0.6
    batch_size: int = 64

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass
class _Teacher:
    """A restored teacher run: its model, weights and data, and the search to decode with."""

    run_config: RunConfig
    tokenizer: Any
    model: Any
    params: Any
    search: Any
    splits: dict  # split name -> examples, as datasets.load_splits reads them
    step: int


def _restore_teacher(o: Options, log: Log, on_inputs_checked: Callable[[], object]) -> _Teacher:
    """Checks the output path, workdir, checkpoint and data, then restores the model."""
    from flaxformer_lite import datasets
    from flaxformer_lite.models import from_config
    from flaxformer_lite.training import restore

    distillation.check_output_dir(o.output_dir)
    if o.batch_size < 1:
        raise line_io.InputError(f"--batch_size must be >= 1, got {o.batch_size}")
    run_config, tokenizer = runner.open_workdir(o.workdir, o.step)
    search = runner.make_search(run_config, beam_size=o.beam_size, alpha=o.alpha)
    splits = datasets.load_splits(distillation.teacher_data(run_config))
    step = restore.resolve_step(o.workdir, o.step, log=log)
    on_inputs_checked()
    params, _ = restore.restore_params(o.workdir, step, log=log)
    model = from_config.build_model(run_config)
    return _Teacher(run_config, tokenizer, model, params, search, splits, step)


def run(
    o: Options, *, log: Log = log_stderr, on_inputs_checked: Callable[[], object] = lambda: None
) -> dict:
    """Writes the distilled corpus of `o.workdir` into `o.output_dir`; returns its manifest.

    `on_inputs_checked` runs once the output path, workdir, checkpoint and data passed
    their checks, before the model is restored (`distill.py` reports the platform there).

    Raises:
      InputError, ConfigError, WorkdirError, FileNotFoundError, StepSpecError,
        CheckpointIntegrityError, CheckpointFormatError: with a message that says what to
        change.
    """
    start = time.perf_counter()
    t = _restore_teacher(o, log, on_inputs_checked)
    sources = examples.texts(t.splits["train"], examples.SOURCE_FIELD)
    gold = examples.texts(t.splits["train"], examples.TARGET_FIELD)
    if not sources:
        raise line_io.InputError(f"the training split of {o.workdir} is empty: nothing to distill")
    distilled = distillation.distill_targets(
        t.model,
        t.params,
        t.tokenizer,
        t.run_config,
        sources,
        search=t.search,
        batch_size=o.batch_size,
        log=log,
    )
    log(reports.summary(distilled.result))
    return _write_distilled(o, t, sources, gold, distilled, start, log)


def _write_distilled(
    o: Options, t: _Teacher, sources, gold, distilled, start: float, log: Log
) -> dict:
    """Writes the distilled corpus, its train flags and its manifest into `o.output_dir`.

    `sources` and `gold` are the training split's lines, `distilled` what
    `distillation.distill_targets` made of them, `start` the run's perf_counter at its
    beginning. Returns the manifest.
    """
    data = t.run_config.data
    src, tgt = distillation.languages(data)
    corpus, split_lines = distillation.corpus_files(
        t.splits, sources, distilled.targets, (src, tgt), log
    )
    names = {
        ours: theirs for ours, theirs in distillation.SPLIT_FILES.items() if theirs in split_lines
    }
    flags = distillation.train_flags(o.output_dir, (src, tgt), names)
    num_changed, num_empty = distillation.changed_and_empty(sources, distilled.targets, gold, log)
    manifest = {
        "workdir": os.path.abspath(o.workdir),
        "step": t.step,
        "beam_size": o.beam_size,
        "alpha": o.alpha,
        "dataset": data.dataset,
        "source_lang": src,
        "target_lang": tgt,
        "num_train_lines": len(sources),
        "num_distinct_sources": distilled.num_distinct,
        "num_changed_targets": num_changed,
        "changed_fraction": num_changed / len(sources),
        "num_empty_targets": num_empty,
        "split_lines": split_lines,
        "decode_seconds": round(distilled.result.seconds, 3),
        "seconds": round(time.perf_counter() - start, 3),
        "train_flags": flags,
    }
    distillation.write_corpus(o.output_dir, corpus, manifest)
    log(distillation.summary(manifest, o.output_dir))
    return manifest
