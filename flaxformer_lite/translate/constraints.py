"""`decode.py --constraints`: decoding whose output contains given target phrases.

Each input line comes with its phrases (terminology), tab-separated on the line of the
constraints file with the same number; an empty line means none. The search is
`search/constrained.py`'s, batched as `runner.decode_lines` batches plain decoding.

Tokenization: a phrase is encoded alone with the run's TARGET vocabulary. Every
vocabulary the project trains keeps SentencePiece's dummy prefix, so a phrase's first
piece starts a word ("forty" -> "▁forty"), exactly as the word is tokenized after a
space in the middle of a sentence (and at its start). A phrase therefore matches where
a word begins, never inside one: "seven" ("▁", "seven") is not met by "forty-seven"
("▁forty", "-", "seven"), while "forty-seven" is. A phrase the vocabulary cannot spell
(it would hold UNK_ID) is refused: no output could contain it.

A line whose phrases no hypothesis met within max_len tokens is decoded again without
constraints, and reported (`unmet_warning`); one output line per input line holds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.constants import UNK_ID
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies
from flaxformer_lite.models import predict
from flaxformer_lite.search.primitives import NEG_INF
from flaxformer_lite.translate import bucketing, input_lines, line_io, runner
from flaxformer_lite.translate.line_io import InputError

MAX_PHRASES = 8  # phrases per line: candidates per beam and step grow with them
MAX_PHRASE_TOKENS = 16  # target tokens per phrase: the beams' banks grow with them

Phrases = list[list[int]]  # one line's phrases as target ids


def check_options(o) -> None:
    """Refuses flags that contradict --constraints (a `cli.decode.Options`), in one line."""
    if not o.constraints:
        return
    given = {
        "--score": o.score,
        "--report": o.report,
        "--interactive": o.interactive,
        "--alignment": o.alignment,
        "--temperature": o.temperature > 0,
    }
    contradicting = [flag for flag, bad in given.items() if bad]
    if contradicting:
        raise InputError(
            f"--constraints runs constrained beam search; {contradicting[0]} does not "
            "apply to it: drop one of them"
        )


def read_phrases(path: str, num_inputs: int) -> list[list[str]]:
    """The phrases of each input line: the file's tab-separated fields, stripped, empty
    ones dropped (an empty line: none).

    Raises:
      InputError: the file's line count differs from the input's.
    """
    lines, _ = line_io.read_lines(path)
    if len(lines) != num_inputs:
        raise InputError(
            f"--constraints has {len(lines)} lines but the input has {num_inputs}; pass one "
            "line per input line (its phrases separated by tabs, an empty line for none)"
        )
    return [[p.strip() for p in line.split("\t") if p.strip()] for line in lines]


def tokenize_phrases(
    target_vocab: Tokenizer,
    phrases_per_line: Sequence[Sequence[str]],
    max_len: int,
    first_number: int = 1,
) -> list[Phrases]:
    """Each line's phrases as target ids (module docstring: a phrase starts a word).

    Raises:
      InputError: naming the line (counted from `first_number`) and the phrase or limit:
        a phrase with characters the vocabulary lacks, more than MAX_PHRASES phrases,
        one longer than MAX_PHRASE_TOKENS tokens, or phrases that leave no room for EOS
        within `max_len` tokens.
    """
    out = []
    for number, phrases in enumerate(phrases_per_line, start=first_number):
        where = f"constraints line {number}"
        if len(phrases) > MAX_PHRASES:
            raise InputError(f"{where}: {len(phrases)} phrases; at most {MAX_PHRASES} per line")
        ids = [target_vocab.encode(p) for p in phrases]
        for phrase, tokens in zip(phrases, ids, strict=True):
            if UNK_ID in tokens:
                raise InputError(
                    f"{where}: the target vocabulary cannot spell {phrase!r} (it has no piece "
                    "for some of its characters); respell or drop the phrase"
                )
            if len(tokens) > MAX_PHRASE_TOKENS:
                raise InputError(
                    f"{where}: {phrase!r} is {len(tokens)} target tokens; at most "
                    f"{MAX_PHRASE_TOKENS} per phrase"
                )
        if sum(map(len, ids)) >= max_len:
            raise InputError(
                f"{where}: the phrases take {sum(map(len, ids))} target tokens, leaving no room "
                f"for EOS within max_len {max_len}; raise --max_len or drop a phrase"
            )
        out.append(ids)
    return out


def padded_shape(phrase_ids: Sequence[Phrases]) -> tuple[int, int]:
    """(C, P): the most phrases of a line and the longest phrase, each rounded up to a
    power of two, so that few shapes compile."""

    def power_of_two(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()

    most = max((len(p) for p in phrase_ids), default=0)
    longest = max((len(t) for p in phrase_ids for t in p), default=0)
    return power_of_two(most), power_of_two(longest)


def pad_phrases(
    phrase_ids: Sequence[Phrases], indices: Sequence[int], rows: int, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The phrases of the chosen lines as (int32[rows, C, P] ids, int32[rows, C] lengths);
    0-padded, and rows beyond `indices` have none."""
    tokens = np.zeros((rows, *shape), np.int32)
    lengths = np.zeros((rows, shape[0]), np.int32)
    for row, i in enumerate(indices):
        for c, ids in enumerate(phrase_ids[i]):
            tokens[row, c, : len(ids)], lengths[row, c] = ids, len(ids)
    return tokens, lengths


def decode_lines(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    run_config: RunConfig,
    lines: Sequence[str] | bucketing.Sources,
    phrase_ids: Sequence[Phrases],
    *,
    search: predict.SearchConfig,
    batch_size: int = 32,
    nbest: int = 1,
) -> tuple[runner.DecodeResult, list[int]]:
    """Decodes `lines` (or their sources) so that every hypothesis of line i contains each
    of `phrase_ids[i]` (`tokenize_phrases`); one result per line, in input order.

    Args:
      model: an autoregressive `models.base.Seq2SeqModel`.
      search: `runner.make_search`'s beam (or greedy) search: its beam_size, alpha,
        max_len and min_len are used.
    Returns:
      (the result, whose n-best lists hold only hypotheses that met every phrase; the
      0-based indices of the lines none met, decoded again without constraints).
    """
    start = time.perf_counter()
    sources = lines
    if not isinstance(lines, bucketing.Sources):
        sources = input_lines.sources_of_lines(tokenizer, lines, run_config)
    lengths = [len(ids) for ids in sources.ids]
    result = runner.DecodeResult([[] for _ in lengths], [[] for _ in lengths], sources, set())
    detokenize = sources.detokenizer(Vocabularies.of(tokenizer).target)
    run = functools.partial(
        _run,
        *(model, params, sources, search),
        buckets=bucketing.bucket_lengths(run_config.data.max_source_len),
        batch_size=batch_size,
        shapes=result.batch_shapes,
    )
    for indices, tokens, scores in run(phrase_ids, lengths):
        result.collect(indices, tokens, scores, detokenize, nbest)
    unmet = _drop_empty_slots(result)
    again = [0] * len(lengths)
    for i in unmet:
        again[i] = lengths[i]
    for indices, tokens, scores in run([[] for _ in phrase_ids], again):  # without phrases
        result.collect(indices, tokens, scores, detokenize, nbest)
    result.seconds = time.perf_counter() - start
    return result, unmet


def decode_records(decoder, lines, sources, phrase_ids, *, batch_size: int, nbest: int, log):
    """`decode_lines` for a `line_decoder.LineDecoder`'s model and search: (one
    `records.Decoded` per line, the `runner.DecodeResult`); a warning is logged for the
    lines whose constraints were not all met."""
    from flaxformer_lite.translate import records

    result, unmet = decode_lines(
        *(decoder.model, decoder.params, decoder.tokenizer, decoder.run_config),
        *(sources, phrase_ids),
        search=decoder.search,
        batch_size=batch_size,
        nbest=nbest,
    )
    if unmet:
        log(unmet_warning(unmet, decoder.search.max_len))
    target = Vocabularies.of(decoder.tokenizer).target
    return records.decoded_lines(result, lines, target, scored=True), result


def _drop_empty_slots(result: runner.DecodeResult) -> list[int]:
    """Removes the hypotheses no beam filled (score NEG_INF) from `result`; returns the
    indices of the decoded lines left without any."""
    unmet = []
    for i, hypotheses in enumerate(result.hypotheses):
        kept = [k for k, (_, score) in enumerate(hypotheses) if score > NEG_INF / 2]
        if hypotheses and not kept:
            unmet.append(i)
        result.hypotheses[i] = [hypotheses[k] for k in kept]
        result.nbest_ids[i] = [result.nbest_ids[i][k] for k in kept]
        result.output_ids[i] = result.nbest_ids[i][0] if kept else []
    return unmet


def _run(model, params, sources, search, phrase_ids, lengths, *, buckets, batch_size, shapes):
    """Yields (line indices, tokens int32[rows, K, L], scores float32[rows, K]) for the lines
    whose `lengths` entry is nonzero, batched by source length as `runner.decode_lines`
    batches them; adds each batch's (rows, length) to `shapes`."""
    rows = bucketing.batch_rows(lengths, batch_size)
    shape, pending = padded_shape(phrase_ids), None
    for indices, length in bucketing.plan_batches(lengths, rows, buckets):
        inputs = bucketing.pad_rows(sources.ids, indices, rows, length)
        inputs, valid = inputs if isinstance(inputs, tuple) else (inputs, None)
        shapes.add(inputs.shape[:2])
        phrases, phrase_lengths = pad_phrases(phrase_ids, indices, rows, shape)
        tokens, scores = predict.decode_with_constraints(
            *(model.module, params, inputs, phrases, phrase_lengths),
            search=search,
            bos_id=model.bos_id,
            eos_id=model.eos_id,
            source_valid=valid,
        )
        # Dispatch is asynchronous: the caller reads the previous batch while this one runs.
        if pending is not None:
            yield pending
        pending = (indices, tokens, scores)
    if pending is not None:
        yield pending


def decode_constrained(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    run_config: RunConfig,
    lines: Sequence[str],
    phrases_per_line: Sequence[Sequence[str]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len: int | None = None,
    nbest: int = 1,
    batch_size: int = 32,
) -> list[list[tuple[str, float]]]:
    """Text in, text out, for a caller such as a server: per line, its n-best (text,
    score) list, best first, every hypothesis holding each of the line's phrases (a line
    none met: its unconstrained n-best); [] for a blank line. Batched; one compilation
    per padded shape (rows, source bucket, phrases, phrase tokens).

    Raises:
      InputError: bad settings (`runner.make_search`) or phrases (`tokenize_phrases`).
    """
    if len(phrases_per_line) != len(lines):
        raise InputError(f"{len(phrases_per_line)} phrase lists for {len(lines)} lines")
    search = runner.make_search(
        run_config, beam_size=beam_size, alpha=alpha, max_len=max_len, nbest=nbest
    )
    target = Vocabularies.of(tokenizer).target
    phrase_ids = tokenize_phrases(target, phrases_per_line, search.max_len)
    result, _ = decode_lines(
        *(model, params, tokenizer, run_config, lines, phrase_ids),
        search=search,
        batch_size=batch_size,
        nbest=nbest,
    )
    return result.hypotheses


def unmet_warning(unmet: Sequence[int], max_len: int) -> str:
    """The warning for the lines (0-based) no hypothesis of met every phrase."""
    shown = ", ".join(str(i + 1) for i in unmet[:5]) + (", ..." if len(unmet) > 5 else "")
    return (
        f"warning: {len(unmet)} line(s) have no output holding all their phrases within "
        f"{max_len} tokens (line {shown}); they were decoded without constraints"
    )
