"""Sequence-level knowledge distillation: a training corpus re-translated by a trained model.

Non-autoregressive models learn from "distilled" data (Kim & Rush 2016, "Sequence-Level
Knowledge Distillation"; Gu et al. 2018): the training sources with, as targets, what a
trained autoregressive model makes of them by beam search. This module decodes them and
writes the `parallel_text` corpus that `train.py` reads; `flaxformer_lite.cli.distill.run`
does it for any training workdir of this library:

  train.{src} train.{tgt}   the run's training sources, in the split's order, and their
                            beam-search translations (one line per training example);
  val.* test.*              the run's validation and test splits with their gold targets:
                            references are never distilled;
  distill.json              where it came from (workdir, step, search) and what changed.

The splits are read by the same code training reads them with (`datasets.load_splits` of
the run's saved `data` section), so the number task and file corpora work alike. Each
distinct source is decoded once: the number task repeats training pairs many times.

The corpus is written into a temporary sibling directory that is renamed to `output_dir`
when complete, so an interrupted run leaves no directory that looks like a corpus (only a
hidden `.{name}.tmp-*` one to delete).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

from flaxformer_lite.atomic_files import atomic_write
from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.data import examples
from flaxformer_lite.translate import input_lines, line_io, reports, runner

MANIFEST = "distill.json"
# Our split name -> the file prefix in the written corpus.
SPLIT_FILES = {"train": "train", "validation": "val", "test": "test"}
DEFAULT_LANGS = ("src", "tgt")  # file suffixes when the run names no languages (number task)

Log = Callable[[str], None]


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Checks and names.


def check_output_dir(output_dir: str) -> None:
    """Refuses an output that exists and is not an empty directory: data is never overwritten.

    Raises:
      InputError: naming the path and what to pass instead.
    """
    if not os.path.lexists(output_dir):
        return
    if os.path.islink(output_dir) or not os.path.isdir(output_dir):
        what = "a symbolic link" if os.path.islink(output_dir) else "not a directory"
        raise line_io.InputError(
            f"--output_dir {output_dir!r} exists and is {what}; pass a new path"
        )
    if os.listdir(output_dir):
        raise line_io.InputError(
            f"--output_dir {output_dir!r} is not empty; pass a new directory "
            "(an existing corpus is never overwritten)"
        )


def languages(data) -> tuple[str, str]:
    """File suffixes of the written corpus: the run's data.source_lang / data.target_lang,
    or src / tgt when it names none (the number task)."""
    if data.source_lang and data.target_lang:
        return data.source_lang, data.target_lang
    return DEFAULT_LANGS


def train_flags(
    output_dir: str, langs: tuple[str, str], split_names: Mapping[str, str]
) -> list[str]:
    """The `train.py` flags that train on the written corpus, one argv entry each.

    The run's other data fields (lengths, vocabulary) come from the config the new run
    passes with `--config`; these only select the corpus.
    """
    names = {ours: theirs for ours, theirs in split_names.items() if ours != "train"}
    return [
        "--config.data.dataset=parallel_text",
        f"--config.data.parallel_text.corpus_dir={os.path.abspath(output_dir)}",
        f"--config.data.source_lang={langs[0]}",
        f"--config.data.target_lang={langs[1]}",
        f"--config.data.split_names={names!r}",
    ]


def shell_line(flags: Sequence[str]) -> str:
    """`flags` for a shell: each quoted only where it needs it, the dict in double quotes."""
    out = []
    for flag in flags:
        name, value = flag.split("=", 1)
        if value.startswith("{"):  # Python literal: double quotes keep its single ones
            out.append(f'{name}="{value}"')
        else:
            out.append(f"{name}={shlex.quote(value)}")
    return " ".join(out)


def one_line(text: str) -> str:
    """`text` without the characters that end a line of a corpus file ("\\n", "\\r").

    `parallel_text` splits its files on "\\n" and drops a final "\\r"; every other character,
    tabs included, is kept, so a source or reference is copied as it is.
    """
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


# Decoding.


@dataclasses.dataclass
class Distilled:
    """The distilled training targets and what it took to make them."""

    targets: list[str]  # one line per training source, in order
    num_distinct: int  # distinct sources decoded
    result: runner.DecodeResult  # of the distinct sources


def distill_targets(
    model,
    params,
    tokenizer,
    run_config: RunConfig,
    sources: Sequence[str],
    *,
    search,
    batch_size: int = 64,
    log: Log = log_stderr,
    progress: bool | None = None,
) -> Distilled:
    """Decodes every distinct source once and maps the translations back onto `sources`.

    Returns one target line per source, in order, as `decode.py` writes it (tabs and line
    breaks made spaces); a blank source gets an empty target without running the model.
    """
    distinct = list(dict.fromkeys(sources))  # first-seen order
    max_source_len = run_config.data.max_source_len
    copy_head = run_config.copy is not None  # its extended ids, as in training
    tokenized = input_lines.tokenize_lines(tokenizer, distinct, max_source_len, extended=copy_head)
    for warning in reports.input_warnings(0, tokenized, max_source_len):
        log(f"{warning} (of the {len(distinct)} distinct training sources)")
    result = runner.decode_lines(
        model,
        params,
        tokenizer,
        run_config,
        tokenized,
        search=search,
        batch_size=batch_size,
        progress=progress,
    )
    by_source = {s: line_io.format_line(h) for s, h in zip(distinct, result.hypotheses)}
    return Distilled([by_source[s] for s in sources], len(distinct), result)


# Writing.


def write_corpus(
    output_dir: str, corpus: Mapping[str, Sequence[str]], manifest: Mapping[str, object]
) -> None:
    """Writes `corpus` ({file name: lines}) and `manifest` (as distill.json) into `output_dir`.

    Everything goes into a temporary sibling directory first, which replaces `output_dir`
    (absent, or an empty directory) only when every file is written and synced: there is
    never a partial corpus under that name.

    Raises:
      InputError: `output_dir` is (or meanwhile became) a file or a non-empty directory.
    """
    check_output_dir(output_dir)
    output_dir = os.path.abspath(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output_dir)}.tmp-")
    try:
        for name, lines in corpus.items():
            data = "".join(f"{one_line(line)}\n" for line in lines).encode("utf-8")
            atomic_write(os.path.join(tmp, name), data)
        text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
        atomic_write(os.path.join(tmp, MANIFEST), text.encode("utf-8"))
        _chmod_as_created(tmp)
        _fsync_dir(tmp)
        check_output_dir(output_dir)  # nothing appeared there while decoding
        try:
            os.rename(tmp, output_dir)  # replaces an empty directory; a non-empty one fails
        except OSError as e:
            raise line_io.InputError(
                f"--output_dir {output_dir!r} could not be written ({e.strerror}); "
                "pass a new directory"
            ) from None
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _chmod_as_created(directory: str) -> None:
    """The permissions `open` and `mkdir` give under the umask (temporary files get 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The corpus of a run.


def teacher_data(run_config: RunConfig):
    """The data section of a teacher run's saved config; a parallel-text corpus must be
    where the run read it (line_io.InputError otherwise)."""
    data = run_config.data
    corpus_dir = data.parallel_text.corpus_dir
    if data.dataset == "parallel_text" and not os.path.isdir(corpus_dir):
        fix = "restore the corpus there"
        if not os.path.isabs(corpus_dir):  # read from train.py's working directory
            fix = f"run distill.py from the directory train.py ran in, or {fix}"
        raise line_io.InputError(
            f"the run's corpus data.parallel_text.corpus_dir={corpus_dir!r} is not a directory "
            f"here; {fix}"
        )
    return data


def corpus_files(
    splits, sources: Sequence[str], targets: Sequence[str], langs: tuple[str, str], log: Log
) -> tuple[dict[str, Sequence[str]], dict[str, int]]:
    """The corpus of a run, ({file name: lines}, {split file name: line count}).

    The training sources get the distilled `targets`; the validation and test splits keep
    their gold targets.
    """
    src, tgt = langs
    held_out, held_out_lines = _held_out_files(splits, langs, log)
    corpus = {f"train.{src}": sources, f"train.{tgt}": targets, **held_out}
    return corpus, {"train": len(sources), **held_out_lines}


def _held_out_files(splits, langs: tuple[str, str], log: Log):
    """The validation and test files of the corpus, gold as in the run, and their line
    counts: ({file name: lines}, {split file name: line count})."""
    src, tgt = langs
    corpus: dict[str, list[str]] = {}
    split_lines: dict[str, int] = {}
    for split in ("validation", "test"):
        if split not in splits or not len(splits[split]):
            if split == "validation":
                log("warning: the run has no validation examples; train.py needs a val split")
            continue
        name = SPLIT_FILES[split]
        corpus[f"{name}.{src}"] = examples.texts(splits[split], examples.SOURCE_FIELD)
        corpus[f"{name}.{tgt}"] = examples.texts(splits[split], examples.TARGET_FIELD)
        split_lines[name] = len(corpus[f"{name}.{src}"])
    return corpus, split_lines


def changed_and_empty(sources, targets, gold, log: Log) -> tuple[int, int]:
    """How many distilled targets differ from the gold ones, and how many non-blank sources
    were translated to an empty line (warned: parallel_text skips such pairs)."""
    num_changed = sum(t != one_line(g) for t, g in zip(targets, gold))
    num_empty = sum(not t for s, t in zip(sources, targets) if s.strip())
    if num_empty:
        log(
            f"warning: {num_empty} training source(s) were translated to an empty line; "
            "parallel_text skips pairs with an empty side"
        )
    return num_changed, num_empty


def summary(manifest: Mapping, output_dir: str) -> str:
    """The one line that ends a run: the counts of the manifest."""
    m = manifest
    splits = ", ".join(f"{k} {v}" for k, v in m["split_lines"].items())
    return (
        f"distilled {m['num_train_lines']} training line(s) ({m['num_distinct_sources']} distinct "
        f"source(s) decoded) with beam {m['beam_size']}, alpha {m['alpha']:g} from step "
        f"{m['step']}: {100 * m['changed_fraction']:.1f}% of the targets differ from the gold "
        f"ones; wrote {output_dir} ({splits} lines) in {m['seconds']:.1f}s"
    )
