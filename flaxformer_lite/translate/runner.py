"""Batched decoding of text lines with a trained workdir; the library behind `decode.py`.

The guarantee: exactly one result per input line, in input order. Empty lines
are passed through as empty outputs without running the model, and over-long
sources are truncated (or refused with `strict`). Reading and writing the
lines is `line_io.py`'s; tokenizing them `input_lines.py`'s; BLEU, plots and
messages are `reports.py`'s; grouping the tokenized lines into padded batches
of a few fixed shapes is `bucketing.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.constants import EOS_ID, PAD_ID
from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies
from flaxformer_lite.models import predict
from flaxformer_lite.training import checkpoint_format
from flaxformer_lite.training.workdir import CHECKPOINT_DIR, WorkdirError, load_run_config
from flaxformer_lite.translate.bucketing import (
    Sources,
    batch_rows,
    bucket_lengths,
    pad_rows,
    plan_batches,
)
from flaxformer_lite.translate.input_lines import tokenize_lines
from flaxformer_lite.translate.line_io import InputError

# Workdir and search settings.


def open_workdir(workdir: str, step: str | int | None = None) -> tuple[RunConfig, Vocabularies]:
    """Checks a training workdir cheaply before the model is restored.

    Args:
      step: a step spec (`restore.resolve_step`): checked here when that is
        cheap (a number, "latest", "best"); "latest-good" is left to the restore,
        which reads the parameters anyway.
    Returns:
      (the run config it saved, the run's source and target vocabularies).
    Raises:
      WorkdirError / FileNotFoundError / StepSpecError / CheckpointIntegrityError
        whose messages name the fix.
    """
    from flaxformer_lite.training import restore

    if not os.path.isdir(workdir):
        raise WorkdirError(
            f"workdir {workdir!r} does not exist; run train.py --workdir {workdir} first, "
            "or pass the --workdir that train.py wrote"
        )
    spec = restore.parse_step(step)
    run_config = load_run_config(workdir)
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
    steps = checkpoint_format.list_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}; run train.py --workdir {workdir}")
    if isinstance(spec, int) and spec not in steps:
        raise FileNotFoundError(
            f"no checkpoint for --step {spec} in {ckpt_dir}; available steps: "
            + ", ".join(map(str, steps))
        )
    if spec == "best":
        restore.resolve_step(workdir, spec)
    try:
        vocab = tokenizer_lib.Vocabularies.load(workdir)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}; restore it, or rerun train.py --workdir {workdir} (the vocabulary is "
            "rebuilt deterministically from the training data)"
        ) from None
    want = (run_config.model.vocab_size, run_config.model.output_vocab_size)
    have = (vocab.source.vocab_size, vocab.target.vocab_size)
    if have != want:
        raise WorkdirError(
            f"the vocabulary in {workdir} has {have[0]} source / {have[1]} target pieces, but "
            f"the model was trained with {want[0]} / {want[1]}: it is another run's vocabulary; "
            "restore the run's own vocab files"
        )
    return run_config, vocab


def make_search(
    run_config: RunConfig,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_len: int | None = None,
    min_len: int = 0,
    nbest: int = 1,
) -> predict.SearchConfig:
    """The search of the decoding flags: temperature > 0 samples, else beam_size > 1 runs
    beam search, else greedy. `max_len` None means the run's data.max_target_len.

    Raises:
      InputError: inconsistent or out-of-range settings.
    """
    max_len = run_config.data.max_target_len if max_len is None else max_len
    model = run_config.model
    if temperature < 0 or alpha < 0 or beam_size < 1 or nbest < 1 or top_k < 0:
        raise InputError("need --temperature, --alpha, --top_k >= 0 and --beam_size, --nbest >= 1")
    if not 0 < top_p <= 1:
        raise InputError(f"need 0 < --top_p <= 1, got {top_p}")
    if max_len < 1 or not 0 <= min_len < max_len:
        raise InputError(f"need --max_len >= 1 and 0 <= --min_len < --max_len, got {max_len}")
    # Learned position tables end at model.max_len; sinusoids have no limit.
    if model.positions == "learned" and max_len > model.max_len:
        raise InputError(f"--max_len {max_len} exceeds the model's {model.max_len} positions")
    if temperature > 0:
        method = "sample"
    else:
        if top_k or top_p != 1.0:
            raise InputError("--top_k and --top_p apply to sampling only: set --temperature > 0")
        method = "beam" if beam_size > 1 else "greedy"
    if nbest > 1 and (method != "beam" or beam_size < nbest):
        raise InputError(
            f"--nbest {nbest} needs beam search with --beam_size >= {nbest} and --temperature 0"
        )
    return predict.SearchConfig(
        method=method,
        max_len=max_len,
        beam_size=beam_size if method == "beam" else 1,
        alpha=alpha,
        temperature=temperature or 1.0,  # unused unless sampling
        top_k=top_k,
        top_p=top_p,
        min_len=min_len,
    )


def make_nat_search(
    run_config: RunConfig,
    *,
    iterations: int | None = None,
    length_beam: int | None = None,
    length_scale: float = 1.0,
    max_len: int | None = None,
    nbest: int = 1,
):
    """The search of a non-autoregressive workdir: Mask-Predict with `iterations` calls over
    `length_beam` length candidates (None: the run's nat section), lengths scaled by
    `length_scale`.

    Raises:
      InputError: out-of-range settings.
    """
    from flaxformer_lite.models.non_autoregressive import NATSearch

    nat = run_config.nat
    if nat.objective == "ctc":
        return _ctc_search(run_config, iterations, length_beam, length_scale, max_len, nbest)
    iterations = nat.iterations if iterations is None else iterations
    length_beam = nat.length_beam if length_beam is None else length_beam
    max_len = run_config.data.max_target_len if max_len is None else max_len
    if iterations < 1 or length_beam < 1:
        raise InputError(
            f"need --iterations >= 1 and --length_beam >= 1, got {iterations}, {length_beam}"
        )
    if not length_scale > 0:
        raise InputError(f"need --length_scale > 0, got {length_scale}")
    if max_len < 2:
        raise InputError(f"need --max_len >= 2 (a token and EOS), got {max_len}")
    model = run_config.model
    if model.positions == "learned" and max_len > model.max_len:
        raise InputError(f"--max_len {max_len} exceeds the model's {model.max_len} positions")
    if nat.length_mode == "fixed" and length_scale != 1.0:
        raise InputError(
            f"--length_scale {length_scale} scales predicted lengths, but this model decodes a "
            "fixed length (nat.length_mode='fixed') and ends at its first EOS; drop --length_scale"
        )
    if nat.length_mode == "fixed" and length_beam > 1:
        raise InputError(
            f"--length_beam {length_beam}: this model decodes a fixed length (nat.length_mode="
            "'fixed'), one candidate per input; drop --length_beam"
        )
    if nbest > length_beam:
        raise InputError(
            f"--nbest {nbest} needs as many length candidates: pass --length_beam >= {nbest}"
        )
    return NATSearch(
        max_len=max_len, iterations=iterations, length_beam=length_beam, length_scale=length_scale
    )


def _ctc_search(run_config: RunConfig, iterations, length_beam, length_scale, max_len, nbest):
    """The one search of a CTC workdir (`models/ctc_nat.py`): argmax, then the collapse."""
    from flaxformer_lite.models.non_autoregressive import NATSearch

    given = {"--iterations": iterations, "--length_beam": length_beam}
    given["--length_scale"] = None if length_scale == 1.0 else length_scale
    for flag, value in given.items():
        if value is not None:
            raise InputError(
                f"{flag} applies to Mask-Predict workdirs; this one's CTC decoder decodes in "
                "one pass and its length comes from the collapse: drop it"
            )
    if nbest > 1:
        raise InputError(f"--nbest {nbest}: a CTC workdir decodes one output per input")
    max_len = run_config.data.max_target_len if max_len is None else max_len
    if max_len < 2:
        raise InputError(f"need --max_len >= 2 (a token and EOS), got {max_len}")
    return NATSearch(max_len=max_len)


# Decoding.


@dataclasses.dataclass
class DecodeResult:
    """Everything decoding produced, one entry per input line, in input order."""

    hypotheses: list[list[tuple[str, float]]]  # n-best (text, score), best first; [] if empty
    output_ids: list[list[int]]  # 1-best generated ids up to and including EOS
    sources: Sources
    batch_shapes: set[tuple[int, int]]  # distinct (rows, length) source shapes sent to the model
    num_output_tokens: int = 0
    seconds: float = 0.0
    # Per line, the generated ids of each n-best hypothesis (EOS included), best first.
    nbest_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.nbest_ids = self.nbest_ids or [[] for _ in self.hypotheses]

    @property
    def texts(self) -> list[str]:
        """The 1-best text per line ("" for empty lines)."""
        return [h[0][0] if h else "" for h in self.hypotheses]

    def collect(self, indices, tokens, scores, detokenize, nbest: int) -> None:
        """Stores one batch: tokens int32[rows, n, max_len], scores float32[rows, n];
        `detokenize(ids, line index)` as `Sources.detokenizer`."""
        tokens, scores = np.asarray(tokens), np.asarray(scores)
        for row, i in enumerate(indices):
            kept = range(min(nbest, tokens.shape[1]))
            self.hypotheses[i] = [
                (detokenize(tokens[row, k], i), float(scores[row, k])) for k in kept
            ]
            self.nbest_ids[i] = [_generated(tokens[row, k]) for k in kept]
            self.output_ids[i] = self.nbest_ids[i][0]
            self.num_output_tokens += len(self.output_ids[i])


def _generated(row: np.ndarray) -> list[int]:
    """The ids of one output row int32[max_len] up to and including its EOS, without
    padding (as `Tokenizer.decode` reads them)."""
    ids = [t for t in row.tolist() if t != PAD_ID]
    return ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def progress_bar(total: int, desc: str, progress: bool | None):
    """A tqdm bar on stderr (None: only on a terminal); disabled when there is nothing to do."""
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    return tqdm(total=total, unit="sent", desc=desc, disable=not (show and total))


@functools.partial(jax.jit, static_argnames=("model", "search"))
def predict_batch(model, params, inputs, search, rng, inputs_valid=None):
    """`model.predict` of one padded batch: (tokens int32[B, n, L], scores float32[B, n]).

    `inputs_valid`: bool[B, S] of feature inputs float32[B, S, F] (None for token ids)."""
    batch = {"inputs": inputs}
    if inputs_valid is not None:
        batch["inputs_valid"] = inputs_valid
    return model.predict(params, batch, search, rng)


def decode_lines(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    run_config: RunConfig,
    lines: Sequence[str] | Sources,
    *,
    search: predict.SearchConfig,
    batch_size: int = 32,
    nbest: int = 1,
    seed: int = 0,
    strict: bool = False,
    progress: bool | None = False,
) -> DecodeResult:
    """Decodes text lines in length buckets; exactly one result per line, in input order.

    Args:
      tokenizer: the shared tokenizer, or the source/target pair.
      lines: text lines, or their `tokenize_lines` result.
      search: from `make_search`; nbest > 1 needs beam search with beam_size >= nbest.
      batch_size: rows per model call (fewer if there are fewer lines).
      seed: sampling key `PRNGKey(seed)`, folded with the batch number.
      progress: tqdm bar on stderr with sentences/s and tokens/s (None: on a terminal only).
    Raises:
      InputError: `strict` and a line longer than the model's source length.
    """
    max_source_len = run_config.data.max_source_len
    sources = lines
    if not isinstance(lines, Sources):
        copy_head = run_config.copy is not None  # its extended ids, as in training
        sources = tokenize_lines(
            tokenizer, lines, max_source_len, strict=strict, extended=copy_head
        )
    lengths = [len(ids) for ids in sources.ids]
    live, rows = sum(1 for n in lengths if n), batch_rows(lengths, batch_size)
    batches = plan_batches(lengths, rows, bucket_lengths(max_source_len))
    result = DecodeResult([[] for _ in lengths], [[] for _ in lengths], sources, set())
    detokenize = sources.detokenizer(Vocabularies.of(tokenizer).target)
    collect = _Collector(result, detokenize, nbest, progress_bar(live, "decode", progress))
    _decode_batches(model, params, sources, batches, rows, search, seed, collect)
    collect.bar.close()
    result.seconds = time.perf_counter() - collect.start
    return result


@dataclasses.dataclass
class _Collector:
    """Stores decoded batches into a `DecodeResult`, advancing a progress bar with tokens/s."""

    result: DecodeResult
    detokenize: Callable  # (ids, line index) -> text, as `Sources.detokenizer`
    nbest: int
    bar: Any  # tqdm
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def __call__(self, indices, tokens, scores) -> None:
        """Stores one batch: tokens int32[rows, n, max_len], scores float32[rows, n]."""
        self.result.collect(indices, tokens, scores, self.detokenize, self.nbest)
        self.bar.update(len(indices))
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.result.num_output_tokens / elapsed:.0f} tok/s")


def _decode_batches(model, params, sources: Sources, batches, rows: int, search, seed, collect):
    """Runs `predict_batch` on each planned (line indices, length) batch of `sources`, padded
    to [rows, length], and hands each output to `collect` while the next batch runs.

    Sampling draws with `fold_in(PRNGKey(seed), batch number)`.
    """
    base_rng = jax.random.PRNGKey(seed)
    pending = None
    for b, (indices, length) in enumerate(batches):
        inputs = pad_rows(sources.ids, indices, rows, length)
        inputs, valid = inputs if isinstance(inputs, tuple) else (inputs, None)
        collect.result.batch_shapes.add(inputs.shape[:2])
        rng = jax.random.fold_in(base_rng, b) if search.method == "sample" else None
        out = predict_batch(model, params, inputs, search, rng, valid)
        # Dispatch is asynchronous: detokenize the previous batch while this one runs.
        if pending is not None:
            collect(*pending)
        pending = (indices, *out)
    if pending is not None:
        collect(*pending)
