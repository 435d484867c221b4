"""Evaluation: teacher-forced metrics and free-running decoding against references."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.experimental import multihost_utils

from flaxformer_lite.bleu import corpus_scores, tokenized_bleu
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.evaluation import exposure_bias, exposure_probe
from flaxformer_lite.evaluation.word_errors import word_error_rate
from flaxformer_lite.objectives import cross_entropy
from flaxformer_lite.parallel import partitioning
from flaxformer_lite.training import step as step_lib


class Evaluation(NamedTuple):
    metrics: dict[str, float]
    pairs: list[tuple[str, str]]  # (prediction, reference) per evaluated example
    bleu_signature: str | None  # sacreBLEU's, when BLEU was computed
    exposure: exposure_bias.Report | None = None  # with a probe; its scalars are in metrics
    bleu_tok_description: str | None = None  # the preprocessing of bleu_tok, when computed

    def record(self) -> dict:
        """What metrics.jsonl and TensorBoard get: the metrics and the report's histogram."""
        return self.metrics | (self.exposure.histograms() if self.exposure else {})


# The exposure-report metrics an evaluation's log line shows.
EXPOSURE_SHOWN = ("eb_tf_token_accuracy", "eb_fr_token_accuracy", "eb_accuracy_gap")


class Stopped(Exception):
    """An evaluation stopped between batches because `should_stop` said so."""

    def __init__(self, done: int, total: int):
        super().__init__(f"stopped after {done} of {total} batches")
        self.done, self.total = done, total


def is_exposure_detail(name: str) -> bool:
    """Whether a metric ("eb_...", or a split's: "test_eb_...") is an exposure-report detail."""
    for prefix in ("", "validation_", "test_"):
        if name.startswith(prefix + "eb_"):
            return name[len(prefix) :] not in EXPOSURE_SHOWN
    return False


def shown_metrics(metrics: dict[str, float]) -> str:
    """An evaluation's log line: the metrics but the exposure report's details.

    The details (prefix swaps, length buckets) are in metrics.jsonl and in the
    report's table.
    """
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if not is_exposure_detail(k))


def evaluate(
    params,
    dataset,
    references: list[str],
    tokenizer,
    mesh,
    *,
    eval_fn,
    decode_fn,
    max_batches: int | None = None,
    bleu: bool = False,
    bleu_lang: str = "",
    wer: bool = False,
    exposure: exposure_probe.Probe | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Evaluation:
    """Teacher-forced metrics, and free-running decoding scored against the references.

    Every process reads the same global batches and feeds its own rows of them;
    the metric sums (replicated by `eval_fn`) and the hypotheses (gathered here)
    reach every process, so all of them compute the same metrics.

    Args:
      dataset: fixed-shape global batches of the split in order (not shuffled).
      references: the split's raw target strings, in the same order.
      eval_fn: (params, batch) -> metric sums (`Seq2SeqModel.evaluate`, jitted).
      decode_fn: (params, batch) -> int32[B, T] best hypotheses.
      bleu: also compute sacreBLEU and chrF (corpus level).
      bleu_lang: with `bleu`, the target language ("de"): also bleu_tok, the BLEU4 on
        lowercased Moses-tokenized text that Multi30k papers publish
        (`bleu.tokenized_bleu`); "": not.
      wer: also the corpus word error rate (`evaluation/word_errors.py`).
      exposure: also the exposure-bias report (`evaluation/exposure_bias.py`) of
        the same examples: `Probe.for_search` of decode_fn's search, so that
        greedy tokens are reused.
      should_stop: asked before each batch and between its programs (a stop signal,
        `StopSignals.poll`); True ends the evaluation by raising `Stopped`.
    Returns:
      metrics, (prediction, reference) pairs of every evaluated example, the
      BLEU signature when `bleu` (computed with the scores, not again), the
      exposure report with its scalars (eb_...) added to the metrics, and bleu_tok's
      preprocessing when it was computed.
    """
    detokenize = row_detokenizer(dataset, tokenizer_lib.Vocabularies.of(tokenizer).target)
    n = len(dataset) if max_batches is None else min(len(dataset), max_batches)
    out = _run_batches(
        params, dataset, n, mesh, eval_fn, decode_fn, detokenize, exposure, should_stop
    )
    refs = references[: len(out.hyps)]
    metrics, signature, tok_description = _corpus_metrics(
        out.totals, out.hyps, refs, wer=wer, bleu=bleu, bleu_lang=bleu_lang
    )
    report = None
    if exposure is not None:
        report = exposure.report(out.probed)
        metrics.update(report.metrics())
    return Evaluation(metrics, list(zip(out.hyps, refs)), signature, report, tok_description)


def _run_batches(
    params, dataset, n, mesh, eval_fn, decode_fn, detokenize, exposure, should_stop
) -> _Outputs:
    """The first `n` batches: metric sums, hypotheses and (with `exposure`) the probe's
    arrays; `Stopped` when `should_stop` says so before a batch or before its probe."""
    out = _Outputs()
    stop = should_stop or (lambda: False)
    for i in range(n):
        if stop():
            raise Stopped(i, n)
        host = dataset[i]
        batch, decoded = _run_batch(host, params, mesh, eval_fn, decode_fn, detokenize, out)
        if exposure is not None and stop():  # the probe's passes cost as much as decoding
            raise Stopped(i, n)
        if exposure is not None:
            with jax.set_mesh(mesh):
                arrays = exposure.arrays(params, batch, decoded)
            out.probed.append(arrays.rows(host["valid"]))
    return out


@dataclasses.dataclass
class _Outputs:
    """What an evaluation's batches gave so far, in dataset order."""

    totals: dict[str, float] = dataclasses.field(default_factory=dict)  # metric sums
    hyps: list[str] = dataclasses.field(default_factory=list)  # one text per valid row
    probed: list[exposure_probe.ProbeArrays] = dataclasses.field(default_factory=list)


def _run_batch(host, params, mesh, eval_fn, decode_fn, detokenize, out: _Outputs):
    """Teacher-forced sums and decoded texts of one global batch, added to `out`.

    `host`: the batch's numpy fields for every row ("valid" bool[B] among them).
    Returns (this process's rows on the mesh, the decoded ids int32[B, T]).
    """
    rows = partitioning.process_rows(len(host["valid"]), mesh)
    batch = step_lib.device_batch({k: v[rows] for k, v in host.items()}, mesh)
    for k, v in jax.device_get(eval_fn(params, batch)).items():
        out.totals[k] = out.totals.get(k, 0.0) + float(v)
    # Under the mesh, the searches keep each device's top-k on its own rows
    # (`search.primitives.rows_top_k`) instead of gathering the batch.
    with jax.set_mesh(mesh):
        decoded = decode_fn(params, batch)  # [B, T]
    # A plain host copy with one process, an all-gather across processes.
    predicted = multihost_utils.process_allgather(decoded, tiled=True)
    out.hyps.extend(detokenize(predicted[host["valid"]], len(out.hyps)))
    return batch, decoded


def _corpus_metrics(totals, hyps, refs, *, wer: bool, bleu: bool, bleu_lang: str = ""):
    """(metrics of the summed teacher-forced totals and of the texts against the references,
    sacreBLEU's signature or None, bleu_tok's preprocessing or None)."""
    metrics = cross_entropy.summarize(totals)
    metrics["exact_match"] = sum(h == r for h, r in zip(hyps, refs)) / max(len(refs), 1)
    if wer:
        metrics["wer"] = word_error_rate(hyps, refs)
    signature = tok_description = None
    if bleu:
        scores = corpus_scores(hyps, refs)
        metrics["bleu"], metrics["chrf"] = scores.bleu, scores.chrf
        signature = scores.signature
    if bleu and bleu_lang:  # cheap: Moses tokenizes some 10,000 lines a second
        tokenized = tokenized_bleu(hyps, refs, bleu_lang)
        metrics["bleu_tok"], tok_description = tokenized.score, tokenized.description
    return metrics, signature, tok_description


def row_detokenizer(dataset, vocab):
    """(ids int[n, L] of examples first..first+n-1 of `dataset`'s split, first) -> texts.

    With the copy head's extended ids (`Tokenized.oov`), each row decodes with its own
    example's unknown pieces; otherwise as `Tokenizer.decode_batch`.
    """
    oov = getattr(getattr(dataset, "tokenized", None), "oov", None)
    if oov is None:
        return lambda ids, first: vocab.decode_batch(ids)
    extended = ExtendedVocabulary(vocab)
    return lambda ids, first: extended.decode_batch(ids, oov[first : first + len(ids)])


def print_examples(dataset, tokenizer, pairs, count: int, log, sources=None) -> None:
    """Logs the first `count` held-out examples and up to `count` of the errors.

    `sources`: what to print for each example's source (a speech split's descriptions);
    None: the detokenized source ids."""
    if sources is None:
        detokenize = row_detokenizer(dataset, tokenizer_lib.Vocabularies.of(tokenizer).source)
        sources = []
        for i in range(len(dataset)):
            batch = dataset[i]
            sources.extend(detokenize(batch["inputs"][batch["valid"]], len(sources)))
    rows = list(zip(sources, pairs))
    errors = [r for r in rows[count:] if r[1][0] != r[1][1]]  # beyond the rows shown first
    wrong = sum(hyp != ref for _, (hyp, ref) in rows)
    log(f"held-out test examples ({wrong} of {len(rows)} wrong), source => prediction:")
    for src, (hyp, ref) in rows[:count] + errors[:count]:
        log(
            f"  {'ok ' if hyp == ref else 'ERR'} {src} => {hyp}"
            + ("" if hyp == ref else f"  (expected: {ref})")
        )
