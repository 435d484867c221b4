"""Forced decoding of reference lines: the log-probability a model gives each target.

The score of a line is the sum of its target tokens' log-probabilities, EOS
included: the number users filter parallel data and rerank n-best lists with.
It is the same number beam search reports for that hypothesis with alpha = 0
(no length penalty). One result per input line, in input order:

  - an empty source line is not scored (its output line is empty);
  - an empty reference line is scored as EOS alone;
  - references longer than the model's target length are cut to it with EOS
    kept last (or refused with `strict`), as sources are.

Batching is decoding's: lines are sorted by (source bucket, target length),
grouped into batches of a fixed number of rows, and both sides are padded to
bucket lengths, so a file compiles the model a few times at most.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import numpy as np

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies, with_eos
from flaxformer_lite.translate import bucketing, runner
from flaxformer_lite.translate.line_io import InputError


@dataclasses.dataclass
class Targets:
    """Tokenized reference lines."""

    ids: list[list[int]]  # per line: target ids ending in EOS; [EOS] for an empty line
    num_truncated: int = 0


def tokenize_targets(
    tokenizer: Tokenizer | Vocabularies,
    lines: Sequence[str],
    max_target_len: int,
    *,
    strict: bool = False,
    oov: Sequence[Sequence[str]] | None = None,
) -> Targets:
    """Target ids as training makes them: `encode(line) + [EOS]`, at most `max_target_len`.

    `oov`: each line's source unknown pieces (`Sources.oov` of a copy head's workdir):
    target pieces that repeat them get their extended ids, as in training.

    Raises:
      InputError: `strict` and some line is too long (names the first line numbers, 1-based).
    """
    encoder = Vocabularies.of(tokenizer).target
    extension = None if oov is None else ExtendedVocabulary(encoder)
    out, too_long = Targets(ids=[]), []
    for number, line in enumerate(lines, start=1):
        if extension is not None and line.strip():
            ids, truncated = extension.encode_target(line, oov[number - 1], max_target_len)
        else:
            ids, truncated = with_eos(encoder.encode(line) if line.strip() else [], max_target_len)
        if truncated:
            too_long.append(number)
        out.ids.append(ids)
    out.num_truncated = len(too_long)
    if strict and too_long:
        raise bucketing.too_long_error(too_long, "reference", max_target_len, "target")
    return out


def _bucket(length: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= length)


def plan_pair_batches(
    source_lengths: Sequence[int],
    target_lengths: Sequence[int],
    batch_size: int,
    source_buckets: Sequence[int],
    target_buckets: Sequence[int],
) -> list[tuple[list[int], int, int]]:
    """Groups the lines with a non-empty source into batches of similar shape.

    Returns:
      [(line indices, at most batch_size of them, padded source length, padded
      target length)], largest first, so that running out of memory shows early.
    """
    live = [i for i, n in enumerate(source_lengths) if n]
    order = sorted(
        live, key=lambda i: (-_bucket(source_lengths[i], source_buckets), -target_lengths[i])
    )
    batches = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest_source = max(source_lengths[i] for i in rows)
        longest_target = max(target_lengths[i] for i in rows)
        batches.append(
            (rows, _bucket(longest_source, source_buckets), _bucket(longest_target, target_buckets))
        )
    return batches


@functools.partial(jax.jit, static_argnums=0)
def score_batch(model, params, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """`model.score` compiled once per model and batch shape: (float32[B, T], float32[B])."""
    return model.score(params, batch)


@dataclasses.dataclass
class ScoreResult:
    """Scores of every line, in input order."""

    sequence: list[float | None]  # log P(reference | source); None for an empty source
    tokens: list[list[float]]  # per target token (EOS included); [] for an empty source
    batch_shapes: set[tuple[int, int, int]]  # distinct (rows, source len, target len) shapes
    seconds: float = 0.0


def score_lines(
    model,
    params,
    run_config: RunConfig,
    sources: bucketing.Sources,
    targets: Targets,
    *,
    batch_size: int = 32,
    progress: bool | None = False,
) -> ScoreResult:
    """Force-decodes every target given its source, in shape buckets.

    Args:
      model: a `models.base.Seq2SeqModel` (its `score` is called).
      run_config: the workdir's; its data.max_source_len / max_target_len bound the buckets.
      sources: from `input_lines.tokenize_lines`; targets: from `tokenize_targets` (same lengths).
      progress: tqdm bar on stderr (None: on a terminal only).
    Raises:
      InputError: a line-count mismatch or batch_size < 1.
    """
    if len(sources.ids) != len(targets.ids):
        raise InputError(f"{len(targets.ids)} targets for {len(sources.ids)} sources")
    source_lengths = [len(ids) for ids in sources.ids]
    target_lengths = [len(ids) for ids in targets.ids]
    live = sum(1 for n in source_lengths if n)
    rows = bucketing.batch_rows(source_lengths, batch_size)
    batches = plan_pair_batches(
        source_lengths,
        target_lengths,
        rows,
        bucketing.bucket_lengths(run_config.data.max_source_len),
        bucketing.bucket_lengths(run_config.data.max_target_len),
    )
    result = ScoreResult([None] * len(source_lengths), [[] for _ in source_lengths], set())
    bar = runner.progress_bar(live, "score", progress)
    start = time.perf_counter()
    for indices, source_len, target_len in batches:
        batch = {
            "inputs": bucketing.pad_rows(sources.ids, indices, rows, source_len),  # int32[B, S]
            "targets": bucketing.pad_rows(targets.ids, indices, rows, target_len),  # int32[B, T]
        }
        result.batch_shapes.add((rows, source_len, target_len))
        token_logp, sequence_logp = map(np.asarray, score_batch(model, params, batch))
        for row, i in enumerate(indices):
            result.sequence[i] = float(sequence_logp[row])
            result.tokens[i] = token_logp[row, : target_lengths[i]].tolist()
        bar.update(len(indices))
    bar.close()
    result.seconds = time.perf_counter() - start
    return result


def format_scores(result: ScoreResult, *, tokens: bool = False) -> list[str]:
    """One line per input: the sequence score, then with `tokens` each token's, tab-separated."""
    lines = []
    for sequence, per_token in zip(result.sequence, result.tokens):
        if sequence is None:
            lines.append("")
            continue
        fields = [sequence, *per_token] if tokens else [sequence]
        lines.append("\t".join(f"{x:.6f}" for x in fields))
    return lines


def summary(result: ScoreResult) -> str:
    """Lines scored, speed, and the number of batch shapes (compilations)."""
    lines = len(result.sequence)
    scored = sum(s is not None for s in result.sequence)
    seconds = max(result.seconds, 1e-9)
    return (
        f"scored {scored} of {lines} line(s) ({lines - scored} with an empty source) in "
        f"{result.seconds:.1f}s: {scored / seconds:.1f} sentences/s, "
        f"{len(result.batch_shapes)} batch shape(s)"
    )
