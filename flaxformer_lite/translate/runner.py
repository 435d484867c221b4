"""Batched decoding of text files with a trained workdir; the library behind `decode.py`.

The guarantee: exactly one output line per input line, in input order. Input
bytes are split on "\\n" only (a trailing "\\r" is dropped), invalid UTF-8 is
replaced, empty lines are passed through as empty outputs without running the
model, over-long sources are truncated (or refused with `strict`), and
hypotheses never contain line or field separators.

Bucketing: sources are sorted by length, grouped into batches of a fixed
number of rows, and each batch is padded to the smallest length of a fixed
set (`bucket_lengths`), so a file of any size and mix of lengths compiles the
search at most `len(bucket_lengths(max_source_len))` times.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

from flaxformer_lite.data import tokenizer as tokenizer_lib
from flaxformer_lite.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, Vocabularies
from flaxformer_lite.models import predict
from flaxformer_lite.training import checkpoints

# Every character that some reader treats as a line break, plus the n-best field separator.
_SEPARATORS = str.maketrans({c: " " for c in "\t\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


class InputError(ValueError):
    """Bad input or flags for decoding; the message says what to change."""


# Reading and writing text.


def read_lines(source: str | os.PathLike | BinaryIO | None) -> tuple[list[str], int]:
    """Reads text lines as decoding sees them.

    Args:
      source: a path, a binary file object, or None / "-" for standard input.
    Returns:
      (lines without their "\\n" / "\\r\\n", number of lines with invalid UTF-8,
      decoded with U+FFFD in place of the bad bytes). A final newline does not
      make an extra empty line; an empty file gives [].
    """
    if source is None or source == "-":
        data = sys.stdin.buffer.read()
    elif hasattr(source, "read"):
        data = source.read()
    else:
        with open(source, "rb") as f:
            data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark is not text
        data = data[3:]
    if not data:
        return [], 0
    raw = data.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    lines, invalid = [], 0
    for line in raw:
        line = line.removesuffix(b"\r")
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            invalid += 1
            lines.append(line.decode("utf-8", errors="replace"))
    return lines, invalid


def write_lines(path: str | None, lines: Sequence[str]) -> None:
    """Writes lines as UTF-8, each ending in "\\n", to `path` or (None / "-") standard output.

    A file is written to a temporary sibling that then replaces `path`, so an
    interrupted run never leaves a partial output file.
    """
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path is None or path == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".decode")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def clean(text: str) -> str:
    """Replaces line breaks and tabs by spaces, so a hypothesis stays on its line and field."""
    return text.translate(_SEPARATORS)


def format_line(hypotheses: Sequence[tuple[str, float]], nbest: int = 1) -> str:
    """One output line: the best text, or `hyp1\\tscore1\\thyp2\\tscore2...` for nbest > 1."""
    if not hypotheses:
        return ""
    if nbest == 1:
        return clean(hypotheses[0][0])
    return "\t".join(f"{clean(text)}\t{score:.4f}" for text, score in hypotheses[:nbest])


# Workdir and search settings.


def open_workdir(workdir: str, step: int | None = None) -> tuple[dict, Vocabularies]:
    """Checks a training workdir cheaply before the model is restored.

    Returns:
      (run config dict, the run's source and target vocabularies).
    Raises:
      WorkdirError / FileNotFoundError whose messages name the fix.
    """
    if not os.path.isdir(workdir):
        raise checkpoints.WorkdirError(
            f"workdir {workdir!r} does not exist; run train.py --workdir {workdir} first, "
            "or pass the --workdir that train.py wrote"
        )
    run_config = checkpoints.load_run_config(workdir)
    ckpt_dir = os.path.join(workdir, checkpoints.CHECKPOINT_DIR)
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    steps = sorted(int(n) for n in names if n.isdigit())  # skips orbax's unfinished saves
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}; run train.py --workdir {workdir}")
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"no checkpoint for --step {step} in {ckpt_dir}; available steps: "
            + ", ".join(map(str, steps))
        )
    try:
        vocab = tokenizer_lib.Vocabularies.load(workdir)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e}; restore it, or rerun train.py --workdir {workdir} (the vocabulary is "
            "rebuilt deterministically from the training data)"
        ) from None
    return run_config, vocab


def make_search(
    run_config: dict,
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
    max_len = run_config["data"]["max_target_len"] if max_len is None else max_len
    model = run_config["model"]
    if temperature < 0 or alpha < 0 or beam_size < 1 or nbest < 1 or top_k < 0:
        raise InputError("need --temperature, --alpha, --top_k >= 0 and --beam_size, --nbest >= 1")
    if not 0 < top_p <= 1:
        raise InputError(f"need 0 < --top_p <= 1, got {top_p}")
    if max_len < 1 or not 0 <= min_len < max_len:
        raise InputError(f"need --max_len >= 1 and 0 <= --min_len < --max_len, got {max_len}")
    # Learned position tables end at model.max_len; sinusoids have no limit.
    if model.get("positions") == "learned" and max_len > model["max_len"]:
        raise InputError(f"--max_len {max_len} exceeds the model's {model['max_len']} positions")
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


# Tokenizing and bucketing.


def bucket_lengths(max_source_len: int) -> tuple[int, ...]:
    """Source lengths batches are padded to: powers of two from 8 below the max, and the max."""
    lengths, n = [], 8  # shorter buckets would save little and compile more often
    while n < max_source_len:
        lengths.append(n)
        n *= 2
    return (*lengths, max_source_len)


@dataclasses.dataclass
class Sources:
    """Tokenized input lines (counts are of lines)."""

    ids: list[list[int]]  # per line: source ids ending in EOS; [] for an empty line
    num_empty: int = 0
    num_truncated: int = 0
    num_unknown: int = 0  # lines with characters the vocabulary does not know (UNK_ID)


def tokenize_lines(
    tokenizer: Tokenizer | Vocabularies,
    lines: Sequence[str],
    max_source_len: int,
    *,
    strict: bool = False,
) -> Sources:
    """Source ids as training makes them: `encode(line) + [EOS]`, at most `max_source_len`.

    `tokenizer`: the shared tokenizer, or the pair whose source side is used.

    Blank lines get [] and are not decoded. Longer sources are cut to
    `max_source_len` ids with EOS kept last, or with `strict` refused.

    Raises:
      InputError: `strict` and some line is too long (names the first line numbers, 1-based).
    """
    encoder = Vocabularies.of(tokenizer).source
    out = Sources(ids=[])
    too_long = []
    for number, line in enumerate(lines, start=1):
        ids = encoder.encode(line) if line.strip() else []
        if not ids:
            out.ids.append([])
            out.num_empty += 1
            continue
        ids.append(EOS_ID)
        out.num_unknown += UNK_ID in ids
        if len(ids) > max_source_len:
            too_long.append(number)
            ids = ids[: max_source_len - 1] + [EOS_ID]
        out.ids.append(ids)
    out.num_truncated = len(too_long)
    if strict and too_long:
        shown = ", ".join(map(str, too_long[:5])) + (", ..." if len(too_long) > 5 else "")
        raise InputError(
            f"{len(too_long)} input line(s) exceed the model's {max_source_len} source tokens "
            f"(line {shown}); shorten them, or drop --strict to truncate"
        )
    return out


def plan_batches(
    lengths: Sequence[int], batch_size: int, buckets: Sequence[int]
) -> list[tuple[list[int], int]]:
    """Groups the non-empty lines into batches of similar length.

    Args:
      lengths: source length per line (0 = empty, not decoded).
    Returns:
      [(line indices, at most batch_size of them, padded length)], longest first,
      so that running out of memory shows on the first batch.
    """
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    batches = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        longest = lengths[rows[0]]
        batches.append((rows, next(b for b in buckets if b >= longest)))
    return batches


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

    @property
    def texts(self) -> list[str]:
        """The 1-best text per line ("" for empty lines)."""
        return [h[0][0] if h else "" for h in self.hypotheses]


def decode_lines(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    run_config: dict,
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
    import jax
    from tqdm import tqdm

    target_vocab = Vocabularies.of(tokenizer).target
    max_source_len = run_config["data"]["max_source_len"]
    sources = lines
    if not isinstance(lines, Sources):
        sources = tokenize_lines(tokenizer, lines, max_source_len, strict=strict)
    if batch_size < 1:
        raise InputError(f"--batch_size must be >= 1, got {batch_size}")
    lengths = [len(ids) for ids in sources.ids]
    live = sum(1 for n in lengths if n)
    # Every batch has the same number of rows, so shapes vary only by bucket.
    rows = min(batch_size, live) or 1
    batches = plan_batches(lengths, rows, bucket_lengths(max_source_len))
    result = DecodeResult([[] for _ in lengths], [[] for _ in lengths], sources, set())
    base_rng = jax.random.PRNGKey(seed)
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=live, unit="sent", desc="decode", disable=not (show and live))
    start = time.perf_counter()

    def collect(indices, tokens, scores):
        tokens, scores = np.asarray(tokens), np.asarray(scores)  # [rows, n, max_len], [rows, n]
        for row, i in enumerate(indices):
            kept = range(min(nbest, tokens.shape[1]))
            result.hypotheses[i] = [
                (target_vocab.decode(tokens[row, k]), float(scores[row, k])) for k in kept
            ]
            ids = [t for t in tokens[row, 0].tolist() if t != PAD_ID]  # as Tokenizer.decode
            result.output_ids[i] = ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids
            result.num_output_tokens += len(result.output_ids[i])
        bar.update(len(indices))
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(f"{result.num_output_tokens / elapsed:.0f} tok/s")

    pending = None
    for b, (indices, length) in enumerate(batches):
        inputs = np.full((rows, length), PAD_ID, np.int32)  # all-PAD rows fill the last batch
        for row, i in enumerate(indices):
            inputs[row, : lengths[i]] = sources.ids[i]
        result.batch_shapes.add(inputs.shape)
        rng = jax.random.fold_in(base_rng, b) if search.method == "sample" else None
        out = predict.decode(
            model, params, inputs, search=search, bos_id=BOS_ID, eos_id=EOS_ID, rng=rng
        )
        # Dispatch is asynchronous: detokenize the previous batch while this one runs.
        if pending is not None:
            collect(*pending)
        pending = (indices, *out)
    if pending is not None:
        collect(*pending)
    bar.close()
    result.seconds = time.perf_counter() - start
    return result


# Reports: BLEU / chrF, attention plots, messages.


def check_line_counts(num_inputs: int, num_references: int) -> None:
    """Raises InputError unless there is one reference line per input line."""
    if num_inputs != num_references:
        raise InputError(
            f"--reference has {num_references} lines but the input has {num_inputs}; "
            "pass one reference line per input line"
        )


def bleu_report(hypotheses: Sequence[str], references: Sequence[str]) -> str:
    """sacreBLEU corpus BLEU and chrF, each with its signature, on two lines.

    Raises:
      InputError: the counts of hypotheses and references differ.
    """
    from sacrebleu.metrics import BLEU, CHRF

    check_line_counts(len(hypotheses), len(references))
    report = []
    for metric in (BLEU(), CHRF()):
        score = metric.corpus_score(list(hypotheses), [list(references)])
        report.append(score.format(signature=str(metric.get_signature())))
    return "\n".join(report)


def check_attention_layer(layer: int, num_layers: int) -> None:
    """Raises InputError unless `layer` indexes one of `num_layers` decoder layers."""
    if not -num_layers <= layer < num_layers:
        raise InputError(f"--attention_layer {layer} is out of range for {num_layers} layer(s)")


def save_attention_pngs(
    model,
    params,
    tokenizer: Tokenizer | Vocabularies,
    source_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    out_dir: str,
    *,
    layer: int = -1,
    count: int = 4,
) -> list[str]:
    """Plots the cross-attention of the first `count` non-empty inputs, one PNG each.

    Args:
      source_ids: per input line, source ids ending in EOS ([] = empty line, skipped).
      output_ids: per input line, the generated ids (EOS included).
      layer: decoder layer (negative counts from the last).
    Returns:
      Paths written: `out_dir/attention_<line index, 0-based, 4 digits>.png`,
      one panel per head, x = source pieces, y = output pieces.
    """
    import jax
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    from flaxformer_lite.models.transformer import Transformer

    num_layers = model.config.num_decoder_layers
    check_attention_layer(layer, num_layers)
    chosen = [i for i, (s, o) in enumerate(zip(source_ids, output_ids)) if s and o][:count]
    if not chosen:
        return []
    os.makedirs(out_dir, exist_ok=True)
    src_len = max(len(source_ids[i]) for i in chosen)
    tgt_len = max(len(output_ids[i]) for i in chosen)
    inputs = np.full((len(chosen), src_len), PAD_ID, np.int32)  # [B, S]
    # Row t of the decoder input is BOS + output[:t]: the query that produced output[t].
    decoder_inputs = np.full((len(chosen), tgt_len), PAD_ID, np.int32)  # [B, T]
    for row, i in enumerate(chosen):
        inputs[row, : len(source_ids[i])] = source_ids[i]
        decoder_inputs[row, : len(output_ids[i])] = [BOS_ID, *output_ids[i][:-1]]

    def weights_fn(params, inputs, decoder_inputs):
        variables, decode = {"params": params}, Transformer.decode
        encoded = model.apply(variables, inputs, method=Transformer.encode)  # [B, S, D]
        _, weights = model.apply(
            variables, encoded, inputs, decoder_inputs, return_weights=True, method=decode
        )
        return weights[layer]  # float32[B, N, T, S]

    weights = np.asarray(jax.jit(weights_fn)(params, inputs, decoder_inputs))
    vocab = Vocabularies.of(tokenizer)
    paths = []
    for row, i in enumerate(chosen):
        src = [vocab.source.id_to_piece(t) for t in source_ids[i]]
        out = [vocab.target.id_to_piece(t) for t in output_ids[i]]
        heads = weights.shape[1]
        # Capped so that long sentences still give a figure within matplotlib's pixel limits.
        width = heads * (1.0 + min(0.3 * len(src), 12.0))
        fig = Figure(figsize=(width, 1.5 + min(0.3 * len(out), 30.0)))
        axes = fig.subplots(1, heads, squeeze=False)[0]
        for h, ax in enumerate(axes):
            ax.imshow(weights[row, h, : len(out), : len(src)], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(src)), src, rotation=90, fontsize=8)
            ax.set_yticks(range(len(out)), out if h == 0 else [], fontsize=8)
            ax.set_title(f"head {h}", fontsize=9)
        layer_name = layer % num_layers
        fig.suptitle(f"line {i}: decoder layer {layer_name} cross-attention", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"attention_{i:04d}.png")
        fig.savefig(path, format="png", dpi=100)
        paths.append(path)
    return paths
