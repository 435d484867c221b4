"""`bench.py --mode files`: trained workdirs decoding the same file, timed side by side.

Each entry is a workdir (autoregressive, Mask-Predict or CTC) with decode.py's settings
(`beam_size`, `iterations`, ...), checked by decode.py's own checks and decoded by
decode.py's own path (`cli/decode.py`'s `LineDecoder`), so its output is decode.py's.
Every entry decodes the file once per batch size untimed (that pass compiles one
search per length bucket), then the timed passes go round-robin over the entries
(A, B, C, A, B, C, ...), so a slower or busier stretch of the machine hits every entry
alike, and the median pass is reported: seconds for the file, sentences/s, ms per
sentence and output tokens/s; with references, the sacreBLEU of the output and the
share of outputs that repeat a token back to back (`evaluation/multimodality.py`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flaxformer_lite.translate.line_io import InputError

# The decode.py settings an entry may set, with their types.
KEYS: dict[str, type] = {
    "beam_size": int,
    "alpha": float,
    "iterations": int,
    "length_beam": int,
    "length_scale": float,
    "max_len": int,
    "step": str,
    "average": int,
    "batching": str,
}
# decode.py reads these for autoregressive workdirs only (and ignores its defaults for the
# others): an entry that sets one for a non-autoregressive workdir is refused.
_AUTOREGRESSIVE_KEYS = ("beam_size", "alpha")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A workdir to time and its decoding settings (decode.py's Options fields)."""

    label: str
    workdir: str
    options: tuple[tuple[str, Any], ...] = ()  # (KEYS name, value) pairs


def parse_entry(spec: str) -> Entry:
    """An entry from `LABEL=WORKDIR[:key=value,...]`, e.g. `beam4=/w/at:beam_size=4`.

    Raises:
      InputError: a malformed spec, an unknown key or a value of the wrong type.
    """
    label, sep, rest = spec.partition("=")
    if not (sep and label and rest):
        raise InputError(f"--files_entry {spec!r}: write LABEL=WORKDIR[:key=value,...]")
    workdir, options = rest, ""
    head, colon, tail = rest.rpartition(":")
    if colon and "=" in tail:  # a workdir path may itself hold a colon
        workdir, options = head, tail
    pairs = []
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key not in KEYS or not eq:
            raise InputError(
                f"--files_entry {label}: unknown setting {item!r}; one of "
                + ", ".join(f"{k}=" for k in KEYS)
            )
        try:
            pairs.append((key, KEYS[key](value)))
        except ValueError:
            raise InputError(
                f"--files_entry {label}: {key}={value!r} is not {KEYS[key].__name__}"
            ) from None
    return Entry(label, workdir, tuple(pairs))


def _checked(entry: Entry):
    """(decode.py's Options, run config, tokenizer, search) of an entry, after decode.py's
    checks; reads no parameters."""
    from flaxformer_lite.cli import decode as decode_cli
    from flaxformer_lite.cli.common import user_errors

    o = decode_cli.Options(workdir=entry.workdir, **dict(entry.options))
    try:
        run_config, tokenizer, search = decode_cli.open_checked(o)
    except (InputError, *user_errors()) as e:
        raise InputError(f"--files_entry {entry.label}: {e}") from None
    given = [k for k in _AUTOREGRESSIVE_KEYS if k in dict(entry.options)]
    if run_config.nat is not None and given:
        raise InputError(
            f"--files_entry {entry.label}: {given[0]} applies to autoregressive workdirs; "
            f"{entry.workdir} holds a non-autoregressive model"
            + ("" if run_config.nat.objective == "ctc" else ": use iterations and length_beam")
        )
    return o, run_config, tokenizer, search


def open_entries(entries: Sequence[Entry], log: Callable[[str], None] = print) -> dict:
    """{label: `line_decoder.LineDecoder`}: every entry checked first, then each workdir's
    checkpoint restored once (decode.py's `step` and `average`).

    Raises:
      InputError: a repeated label, or an entry decode.py would refuse (its message).
    """
    from flaxformer_lite.cli import decode as decode_cli

    labels = [e.label for e in entries]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise InputError(f"--files_entry label {repeated[0]!r} is given twice")
    checked = [_checked(e) for e in entries]
    return {
        e.label: decode_cli.line_decoder_of(*c, log=log)
        for e, c in zip(entries, checked, strict=True)
    }


@dataclasses.dataclass(frozen=True)
class Timed:
    seconds: float  # median of the timed passes
    samples: list[float]
    output: Any  # what the untimed first pass returned


def alternate(
    runs: Mapping[str, Callable[[int], Any]],
    batch_sizes: Sequence[int],
    repeats: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[tuple[str, int], Timed]:
    """{(label, batch): Timed} of `runs[label](batch)`: for each batch size, each run once
    untimed (it compiles), then `repeats` rounds calling every run once, in order."""
    timed = {}
    for batch in batch_sizes:
        outputs = {label: run(batch) for label, run in runs.items()}
        samples: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(repeats):
            for label, run in runs.items():
                start = clock()
                run(batch)
                samples[label].append(clock() - start)
        for label in runs:
            median = statistics.median(samples[label])
            timed[label, batch] = Timed(median, samples[label], outputs[label])
    return timed


def measure(
    decoders: Mapping[str, Any],
    lines: Sequence[str],
    references: Sequence[str] | None = None,
    *,
    batch_sizes: Sequence[int] = (1, 64),
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[dict], dict[tuple[str, int], list[str]]]:
    """Times `decoders` ({label: LineDecoder}) on `lines` with `alternate`.

    Returns:
      (one row per label and batch size, {(label, batch): the output texts}).
    """
    from flaxformer_lite.translate import input_lines

    runs = {}
    for label, decoder in decoders.items():
        # Tokenized once per workdir (vocabularies differ), outside the timed passes.
        sources = input_lines.sources_of_lines(decoder.tokenizer, lines, decoder.run_config)
        at = {b: dataclasses.replace(decoder, batch_size=b) for b in batch_sizes}
        runs[label] = lambda b, at=at, s=sources: at[b].decode(lines, sources=s)[1]
    timed = alternate(runs, batch_sizes, repeats, clock=clock)
    rows = [
        _row(label, batch, t, decoders[label], references)
        for batch in batch_sizes
        for label in decoders
        for t in [timed[label, batch]]
    ]
    return rows, {key: t.output.texts for key, t in timed.items()}


def _row(label: str, batch: int, t: Timed, decoder, references) -> dict:
    """The figures of one entry at one batch size; `t.output` is its `runner.DecodeResult`."""
    from flaxformer_lite import bleu
    from flaxformer_lite.data.tokenizer import Vocabularies
    from flaxformer_lite.translate import reports

    result = t.output
    sentences = sum(1 for ids in result.sources.ids if len(ids))  # blank lines cost nothing
    row = {
        "label": label,
        "batch": batch,
        "seconds": t.seconds,
        "samples": t.samples,
        "sentences": sentences,
        "sentences_per_s": sentences / t.seconds,
        "ms_per_sentence": 1000 * t.seconds / max(sentences, 1),
        "tokens_per_s": result.num_output_tokens / t.seconds,
    }
    if references is not None:
        target = Vocabularies.of(decoder.tokenizer).target
        mm = reports.multimodality_of(result, references, target)
        row["bleu"] = bleu.corpus_scores(result.texts, references).bleu
        row["repeated"], row["reference_repeated"] = mm.repeated, mm.reference_repeated
    return row


HEADER = "entry            batch |  s/file |   sent/s | ms/sent |    tok/s |  BLEU | repeats"


def row_line(row: dict) -> str:
    bleu = f"{row['bleu']:5.2f}" if "bleu" in row else "    -"
    repeated = f"{row['repeated']:6.1%}" if "repeated" in row else "      -"
    return (
        f"{row['label']:<16} {row['batch']:>5} | {row['seconds']:7.3f} | "
        f"{row['sentences_per_s']:8.1f} | {row['ms_per_sentence']:7.2f} | "
        f"{row['tokens_per_s']:8.0f} | {bleu} | {repeated}"
    )


def run_files(
    entries: Sequence[Entry],
    input_path: str,
    reference_path: str | None = None,
    *,
    batch_sizes: Sequence[int] = (1, 64),
    repeats: int = 3,
    limit: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Decodes the first `limit` lines (0: all) of `input_path` with every entry, timed
    alternately (`measure`); logs a table and returns {"rows", "entries", "input", ...}.

    Raises:
      InputError: bad settings, a missing file, line counts that differ, or an entry
        decode.py would refuse.
    """
    from flaxformer_lite.translate import line_io, reports

    if not entries:
        raise InputError("--mode files needs at least one --files_entry LABEL=WORKDIR")
    if not batch_sizes or min(batch_sizes) < 1 or repeats < 1 or limit < 0:
        raise InputError("need positive --files_batches, --repeats >= 1 and --files_limit >= 0")
    line_io.check_paths((("files_input", input_path), ("files_reference", reference_path)), None)
    lines = line_io.read_lines(input_path)[0][: limit or None]
    references = None
    if reference_path:
        references = line_io.read_lines(reference_path)[0][: limit or None]
        reports.check_line_counts(len(lines), len(references))
    decoders = open_entries(entries, log)
    log(
        f"{len(lines)} lines of {input_path}; {len(entries)} entries decoding in turn, median "
        f"of {repeats} passes each, after one untimed pass (compiles) per batch size"
    )
    rows, _ = measure(decoders, lines, references, batch_sizes=batch_sizes, repeats=repeats)
    log(HEADER)
    for row in rows:
        log(row_line(row))
    return {
        "input": input_path,
        "reference": reference_path,
        "lines": len(lines),
        "repeats": repeats,
        "entries": [{"label": e.label, "workdir": e.workdir, **dict(e.options)} for e in entries],
        "rows": rows,
    }
