"""What `decode.py` does with its flag values: decode, or with `score` force-decode, a file.

With `report`, decoding is greedy and the exposure-bias report of the output
against the references follows (`translate/exposure.py`). With `interactive`
(or a terminal as input) each line is answered as soon as it is read
(`translate/interactive.py`); both modes write `translate/records.py`'s lines.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from flaxformer_lite.data.tokenizer import Vocabularies
from flaxformer_lite.models import from_config
from flaxformer_lite.translate import (
    constraints,
    exposure,
    input_lines,
    interactive,
    line_decoder,
    line_io,
    records,
    reports,
    runner,
)


@dataclasses.dataclass(frozen=True)
class Options:
    """The flag values of decode.py (see its flag help for each)."""

    workdir: str
    step: str | int | None = None  # a step spec: see training.restore.resolve_step
    average: int = 1
    input: str | None = None
    output: str | None = None
    beam_size: int = 4
    alpha: float = 0.6
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_len: int | None = None
    min_len: int = 0
    nbest: int = 1
    seed: int = 0
    batch_size: int = 32
    batching: str = "padded"
    strict: bool = False
    reference: str | None = None
    bleu_lang: str | None = None  # None: the run config's data.target_lang
    bleu_lowercase: bool = True
    attention_png: str | None = None
    attention_count: int = 4
    attention_layer: int = -1
    score: bool = False
    score_tokens: bool = False
    report: bool = False
    iterations: int | None = None  # non-autoregressive workdirs only
    length_beam: int | None = None
    length_scale: float | None = None
    format: str = "text"  # one of records.FORMATS
    alignment: bool = False
    alignment_layer: int = -1
    interactive: bool = False
    constraints: str | None = None  # tab-separated target phrases, one line per input line

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check_options(o: Options) -> None:
    inputs = (("input", o.input), ("reference", o.reference), ("constraints", o.constraints))
    line_io.check_paths(inputs, o.output)
    if o.score and not o.reference:
        raise line_io.InputError("--score needs --reference: the target lines to score")
    if o.score_tokens and not o.score:
        raise line_io.InputError("--score_tokens applies to --score only")
    if (o.bleu_lang or not o.bleu_lowercase) and (o.score or not o.reference):
        raise line_io.InputError(
            "--bleu_lang and --bleu_lowercase set the BLEU of decoding with --reference"
            + ("; --score computes none: drop them or --score" if o.score else ": add it")
        )
    if o.score and o.attention_png:
        raise line_io.InputError("--attention_png plots decoding: drop it or --score")
    if o.format not in records.FORMATS:
        raise line_io.InputError(f"--format {o.format!r}: one of {', '.join(records.FORMATS)}")
    if o.batching == "continuous" and (o.score or o.report or o.constraints):
        raise line_io.InputError(
            "--batching continuous decodes: drop it with --score, --report or --constraints"
        )
    if o.batching not in ("padded", "continuous"):
        raise line_io.InputError(f"--batching {o.batching!r}: padded or continuous")
    if o.score and (o.alignment or o.format != "text"):
        raise line_io.InputError("--alignment and --format apply to decoding: drop them or --score")
    if o.interactive:
        whole_input = ("reference", "score", "report", "attention_png", "constraints")
        given = [f"--{k}" for k in whole_input if getattr(o, k)]
        given += ["--output"] if o.output not in (None, "-") else []
        if given:
            raise line_io.InputError(
                f"--interactive answers each line on stdout as it is read; {given[0]} needs "
                "the whole input: drop one of them"
            )
    exposure.check_options(o)
    constraints.check_options(o)


def _is_interactive(o: Options) -> bool:
    """--interactive, or standard input is a terminal and nothing needs the whole input:
    a person typing expects each answer at once, while a pipe may carry a whole file
    (decoded faster in batches; a program that waits for each answer passes --interactive)."""
    if o.interactive:
        return True
    whole_input = o.reference or o.score or o.report or o.attention_png or o.constraints
    if o.input not in (None, "-") or o.output not in (None, "-") or whole_input:
        return False
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, OSError, ValueError):  # a closed or replaced stdin
        return False


def _check_speech_options(o: Options) -> None:
    """A speech workdir decodes WAV files; what needs source text is refused in one line."""
    for flag in ("score", "report"):
        if getattr(o, flag):
            raise line_io.InputError(
                f"--{flag} is not supported for a speech workdir ({o.workdir} reads WAV "
                "files); decode with --reference for BLEU, WER and exact match"
            )
    if o.strict:
        raise line_io.InputError(
            "--strict refuses long text lines; a speech workdir reads WAV files"
        )


def _check_model_kind(o: Options, non_autoregressive: bool) -> None:
    """Flags that only one model kind reads are refused for the other."""
    nat_flags = [f"--{k}" for k in ("iterations", "length_beam", "length_scale")]
    given = [f for f in nat_flags if getattr(o, f[2:]) is not None]
    if not non_autoregressive and given:
        raise line_io.InputError(
            f"{given[0]} applies to non-autoregressive workdirs (a nat section in their run "
            f"config); {o.workdir} holds an autoregressive model: use --beam_size"
        )
    if non_autoregressive:
        if o.temperature > 0:
            raise line_io.InputError(
                "--temperature samples an autoregressive decoder; this workdir holds a "
                "non-autoregressive one: use --iterations and --length_beam"
            )
        if o.report:
            raise line_io.InputError(
                "--report compares teacher forcing with autoregressive decoding; this workdir "
                "holds a non-autoregressive model"
            )
        if o.min_len or o.constraints:
            flag = "--min_len" if o.min_len else "--constraints"
            raise line_io.InputError(f"{flag} applies to autoregressive workdirs only")


def _check_ctc_options(o: Options) -> None:
    """A CTC decoder's positions are upsampled source positions, not target tokens: what
    reads one value per target token is undefined for it (`models/ctc_nat.py`)."""
    for flag, why in (
        ("score_tokens", "its log-likelihood sums over alignments, with no per-token split"),
        ("alignment", "its decoder positions are upsampled source positions, not words"),
        ("attention_png", "its decoder positions are upsampled source positions, not tokens"),
    ):
        if getattr(o, flag):
            raise line_io.InputError(
                f"--{flag} is undefined for a CTC workdir ({o.workdir}): {why}"
            )


def run(o: Options, on_inputs_checked: Callable[[], object] = lambda: None) -> None:
    """Decodes (or scores) `o.input` into `o.output`, reporting on stderr.

    `on_inputs_checked` runs once flags, workdir, inputs and the checkpoint
    passed their checks (`decode.py` reports the platform there, so a user
    mistake still prints one line).

    Raises:
      InputError, WorkdirError, FileNotFoundError, StepSpecError,
        CheckpointIntegrityError, CheckpointFormatError: with a message that says
        what to change.
    """
    from flaxformer_lite.training import restore

    run_config, tokenizer, search = open_checked(o)
    if o.attention_png:
        num_layers = run_config.model.num_decoder_layers
        reports.check_attention_layer(o.attention_layer, num_layers)
    if o.alignment:
        line_decoder.check_alignment(run_config, o.alignment_layer)
    if _is_interactive(o):
        _interactive(o, run_config, tokenizer, search, on_inputs_checked)
        return
    lines, references, num_invalid = _read_inputs(o)
    if not lines:
        line_io.write_lines(o.output, [])
        log("input is empty: nothing to decode")
        return
    sources = input_lines.sources_of_lines(tokenizer, lines, run_config, strict=o.strict)
    for warning in reports.input_warnings(num_invalid, sources, run_config.data.max_source_len):
        log(warning)
    phrase_ids = _read_constraints(o, len(lines), tokenizer, search)
    params, _ = restore.restore_params(o.workdir, o.step, average=o.average, log=log)
    on_inputs_checked()
    model = from_config.build_model(run_config)
    if o.score:
        _score(o, model, params, tokenizer, run_config, sources, references)
    else:
        decoder = _line_decoder(o, model, params, tokenizer, run_config, search)
        _decode(o, decoder, lines, sources, references, phrase_ids)


def open_checked(o: Options):
    """(run config, tokenizer, search) of `o.workdir` once the flags passed decode.py's
    checks, those of the workdir's model kind included; the search is None with `score`.
    Reads no parameters (`line_decoder_of` restores them).

    Raises:
      InputError, WorkdirError, FileNotFoundError, StepSpecError: as `run`.
    """
    _check_options(o)
    run_config, tokenizer = runner.open_workdir(o.workdir, o.step)
    _check_model_kind(o, run_config.nat is not None)
    if run_config.nat is not None and run_config.nat.objective == "ctc":
        _check_ctc_options(o)
    if input_lines.is_speech(run_config):
        _check_speech_options(o)
    return run_config, tokenizer, None if o.score else _search(o, run_config)


def line_decoder_of(o: Options, run_config, tokenizer, search, log=log):
    """The `LineDecoder` that decodes for `o`: its checkpoint restored (`o.step`,
    `o.average`) and its flags' settings, as `run` builds it."""
    from flaxformer_lite.training import restore

    params, _ = restore.restore_params(o.workdir, o.step, average=o.average, log=log)
    model = from_config.build_model(run_config)
    return _line_decoder(o, model, params, tokenizer, run_config, search)


def _read_constraints(o: Options, num_lines: int, tokenizer, search):
    """Each input line's --constraints phrases as target ids (None without the flag)."""
    if not o.constraints:
        return None
    phrases = constraints.read_phrases(o.constraints, num_lines)
    target = Vocabularies.of(tokenizer).target
    return constraints.tokenize_phrases(target, phrases, search.max_len)


def _search(o: Options, run_config):
    """The search of the flags: Mask-Predict for a non-autoregressive workdir, else greedy,
    beam or sampling (`runner.make_nat_search`, `runner.make_search`)."""
    if run_config.nat is not None:
        return runner.make_nat_search(
            run_config,
            iterations=o.iterations,
            length_beam=o.length_beam,
            length_scale=1.0 if o.length_scale is None else o.length_scale,
            max_len=o.max_len,
            nbest=o.nbest,
        )
    return runner.make_search(
        run_config,
        **{k: getattr(o, k) for k in ("beam_size", "alpha", "temperature", "top_k")},
        **{k: getattr(o, k) for k in ("top_p", "max_len", "min_len", "nbest")},
    )


def _read_inputs(o: Options) -> tuple[list[str], list[str] | None, int]:
    """(input lines, reference lines or None, the number of lines with bytes that are not
    text, as `line_io.read_lines` counts them).

    Such reference lines count only when the references are scored or reported on.
    """
    lines, num_invalid = line_io.read_lines(o.input)
    references = None
    if o.reference:
        references, num_invalid_ref = line_io.read_lines(o.reference)
        reports.check_line_counts(len(lines), len(references))
        num_invalid += num_invalid_ref if o.score or o.report else 0
    return lines, references, num_invalid


def _line_decoder(o: Options, model, params, tokenizer, run_config, search):
    return line_decoder.LineDecoder(
        *(model, params, tokenizer, run_config, search),
        **{k: getattr(o, k) for k in ("nbest", "batch_size", "seed", "strict", "batching")},
        alignment_layer=o.alignment_layer if o.alignment else None,
    )


def _interactive(o: Options, run_config, tokenizer, search, on_inputs_checked) -> None:
    """Answers each input line as it is read (`interactive.serve`), until the input ends."""
    from flaxformer_lite.training import restore

    params, _ = restore.restore_params(o.workdir, o.step, average=o.average, log=log)
    on_inputs_checked()
    model = from_config.build_model(run_config)
    decoder = _line_decoder(o, model, params, tokenizer, run_config, search)
    log("interactive: one answer per input line, as each line is read")
    stream = sys.stdin.buffer if o.input in (None, "-") else open(o.input, "rb")  # noqa: SIM115
    try:
        count = interactive.serve(
            decoder, stream, sys.stdout.buffer, output_format=o.format, log=log
        )
    except BrokenPipeError:  # the reader went away: nobody is left to answer
        # Python's advice: point stdout at /dev/null, so the flush at exit cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
    log(f"answered {count} line(s)")


def _decode(o, decoder: line_decoder.LineDecoder, lines, sources, references, phrase_ids) -> None:
    model, params = decoder.model, decoder.params
    tokenizer, run_config = decoder.tokenizer, decoder.run_config
    targets = None
    if o.report:  # the references' checks come before decoding
        targets = exposure.tokenize_references(
            tokenizer, references, run_config, strict=o.strict, log=log, oov=sources.oov
        )
    if phrase_ids is None:
        # progress=None: a bar only on a terminal.
        decoded, result = decoder.decode(lines, sources=sources, progress=None)
    else:
        decoded, result = constraints.decode_records(
            decoder, lines, sources, phrase_ids, batch_size=o.batch_size, nbest=o.nbest, log=log
        )
    line_io.write_lines(o.output, [records.format_record(d, o.format, o.nbest) for d in decoded])
    log(reports.summary(result))
    if references is not None:
        for line in reports.reference_lines(
            result, references, run_config, tokenizer, o.bleu_lang, o.bleu_lowercase
        ):
            log(line)
    if o.attention_png and o.attention_count:
        paths = reports.save_attention_pngs(
            model,
            params,
            tokenizer,
            sources.ids,
            result.output_ids,
            o.attention_png,
            layer=o.attention_layer,
            count=o.attention_count,
            oov=sources.oov,
        )
        log(f"wrote {len(paths)} attention plot(s) to {o.attention_png}")
    if o.report:
        report = exposure.report_lines(
            *(model, params, run_config, sources, targets, result.output_ids),
            search=decoder.search,
            batch_size=o.batch_size,
            # Re-tokenizing text would lose the copy head's extended ids.
            target_vocab=None if sources.oov is not None else Vocabularies.of(tokenizer).target,
        )
        log(report.table())


def _score(o, model, params, tokenizer, run_config, sources, references) -> None:
    from flaxformer_lite.translate import scoring

    max_target_len = run_config.data.max_target_len
    targets = scoring.tokenize_targets(
        tokenizer, references, max_target_len, strict=o.strict, oov=sources.oov
    )
    if targets.num_truncated:
        log(
            f"warning: {targets.num_truncated} reference line(s) longer than {max_target_len} "
            "target tokens were truncated (--strict refuses them)"
        )
    result = scoring.score_lines(
        model, params, run_config, sources, targets, batch_size=o.batch_size, progress=None
    )
    line_io.write_lines(o.output, scoring.format_scores(result, tokens=o.score_tokens))
    log(scoring.summary(result))
