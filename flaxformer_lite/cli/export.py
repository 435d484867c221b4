"""What `export.py` does: a training workdir's checkpoint -> a CTranslate2 or Hugging Face
model directory, checked against our model before it is kept.

The steps: check the workdir and that the engine can represent its model (one line
naming the field when not), restore the parameters (`--step`, `--average`), convert
them (`export/layout.py`, then `to_ctranslate2.py` or `to_huggingface.py`) into a
fresh directory next to OUT, bundle the SentencePiece model(s), score probe pairs
with both our model and the exported one (`export/parity.py`), and only then rename
the directory to OUT. An existing non-empty OUT is never touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.export import int8_check, parity
from flaxformer_lite.export.layout import ExportError, check_exportable, model_layout

ENGINES = ("ctranslate2", "hf")
FP32_TOLERANCE = 1e-4  # largest |log p| difference accepted for a float32 export
MANIFEST = "flaxformer_lite_export.json"


@dataclasses.dataclass(frozen=True)
class Options:
    """The flag values of export.py."""

    workdir: str
    to: str
    out: str
    step: str | int | None = None
    average: int = 1
    quantization: str = "float32"  # ctranslate2 only
    int8_weight_bits: int = 8  # 7: int8 weights within [-63, 63], safe without VNNI
    max_positions: int = 1024  # rows of the exported position table
    probes: int = 16  # probe pairs scored by both models


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check_options(o: Options) -> None:
    if o.to not in ENGINES:
        raise ExportError(f"--to {o.to!r} is not one of {', '.join(ENGINES)}")
    if o.to == "hf" and o.quantization != "float32":
        raise ExportError("--quantization applies to --to ctranslate2; Hugging Face is float32")
    if os.path.exists(o.out) and (not os.path.isdir(o.out) or os.listdir(o.out)):
        raise ExportError(
            f"{o.out} already exists and is not an empty directory; choose a new --out or "
            "remove it yourself"
        )
    if o.max_positions < 1:
        raise ExportError(f"--max_positions must be positive, got {o.max_positions}")
    if o.int8_weight_bits not in int8_check.WEIGHT_BITS:
        raise ExportError(f"--int8_weight_bits must be 8 or 7, got {o.int8_weight_bits}")
    if o.int8_weight_bits != 8 and o.quantization not in int8_check.INT8_QUANTIZATIONS:
        raise ExportError(
            f"--int8_weight_bits applies to --quantization int8 or int8_float32, "
            f"not {o.quantization}"
        )


def probe_pairs(vocab, count: int, max_source: int, max_target: int, seed: int = 0):
    """Deterministic (source ids, target ids) pairs of ordinary pieces (ids >= 4), of varied
    lengths up to the run's limits (EOS excluded)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        s = 1 + (i * 7) % max(1, max_source - 1)
        t = 1 + (i * 5) % max(1, max_target - 1)
        pairs.append(
            (
                rng.integers(4, vocab.source.vocab_size, s).tolist(),
                rng.integers(4, vocab.target.vocab_size, t).tolist(),
            )
        )
    return pairs


def _pieces(tokenizer) -> list[str]:
    return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def _spm_files(workdir: str, vocab) -> tuple[str, str]:
    from flaxformer_lite.data import tokenizer as tokenizer_lib

    names = tokenizer_lib.Vocabularies.files(workdir, vocab.shared)
    return (names[0], names[0]) if vocab.shared else (names[0], names[1])


def _exported_scores(o: Options, directory: str, vocab, pairs):
    """The exported model's token log-probs of `pairs`, read back from `directory`."""
    sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
    if o.to == "ctranslate2":
        import ctranslate2

        translator = ctranslate2.Translator(directory, device="cpu")
        src = [[vocab.source.id_to_piece(i) for i in s] for s in sources]
        tgt = [[vocab.target.id_to_piece(i) for i in t] for t in targets]
        return parity.ctranslate2_scores(translator, src, tgt, sources, targets)
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(directory).eval()
    return parity.marian_scores(model, sources, targets)[0]


def _check_engine(o: Options, run_config: RunConfig) -> str:
    """Refuses, before any parameter is read, what the engine cannot run; its name."""
    from flaxformer_lite.export import to_ctranslate2, to_huggingface

    engine = "CTranslate2" if o.to == "ctranslate2" else "Hugging Face"
    check_exportable(run_config, engine)
    if o.to == "hf":
        to_huggingface.check_representable(run_config.model)
        to_huggingface.require()
    else:
        to_ctranslate2.require()
        if o.quantization not in to_ctranslate2.QUANTIZATIONS:
            raise ExportError(
                f"--quantization {o.quantization!r} is not one of "
                + ", ".join(to_ctranslate2.QUANTIZATIONS)
            )
    return engine


def _check_int8(o: Options, layout, pieces, staging: str, vocab, pairs, want, log=log):
    """Measures the int8 model where it was written, in a child process that names its
    GEMM backend; above `int8_check.INT8_WARNING` also the alternatives, and warns.

    Returns (the largest |log p| difference, manifest fields).
    """
    from flaxformer_lite.export import to_ctranslate2

    src = [[vocab.source.id_to_piece(i) for i in s] for s, _ in pairs]
    tgt = [[vocab.target.id_to_piece(i) for i in t] for _, t in pairs]

    def measure(directory: str, env: dict | None) -> int8_check.Measured:
        got, backend = int8_check.score_in_child(directory, src, tgt, env)
        return int8_check.Measured("as exported", parity.max_difference(want, got), backend)

    def rewrite(directory: str, bits: int) -> None:
        to_ctranslate2.save(layout, *pieces, directory, o.quantization, bits)

    measured = measure(staging, None)
    extra = {"int8_weight_bits": o.int8_weight_bits, "ct2_int8_backend": measured.backend}
    log(
        f"int8 on this machine: max |log p difference| = {measured.difference:.3g} "
        f"({measured.backend})"
    )
    if measured.difference > int8_check.INT8_WARNING:
        tried = int8_check.alternatives(staging, o.int8_weight_bits, rewrite, measure)
        log(int8_check.warning(measured, tried))
        extra["int8_warning"] = True
        extra["int8_alternatives"] = [dataclasses.asdict(t) for t in tried]
    return measured.difference, extra


def _check_parity(o: Options, run_config, params, layout, pieces, staging, vocab, log):
    """Scores probe pairs with our model and the exported one in `staging`.

    Returns (the probe pairs, the largest log-probability difference, manifest fields of
    the int8 check).

    Raises:
      ExportError: a float32 export differs by more than FP32_TOLERANCE.
    """
    from flaxformer_lite.models import from_config

    data = run_config.data
    pairs = probe_pairs(vocab, o.probes, data.max_source_len, data.max_target_len)
    model = from_config.build_model(run_config)
    want = parity.ours(model, params, [p[0] for p in pairs], [p[1] for p in pairs])
    manifest_extra: dict = {}
    if o.quantization in int8_check.INT8_QUANTIZATIONS:
        difference, manifest_extra = _check_int8(
            o, layout, pieces, staging, vocab, pairs, want, log
        )
    else:
        got = _exported_scores(o, staging, vocab, pairs)
        difference = parity.max_difference(want, got)
    exact = o.quantization == "float32"
    if exact and not difference <= FP32_TOLERANCE:
        raise ExportError(
            f"the exported model's log-probabilities differ from ours by {difference:.3g} "
            f"(> {FP32_TOLERANCE:g}) on {len(pairs)} probe pairs; nothing was written"
        )
    return pairs, difference, manifest_extra


def export(o: Options, *, log: Callable[[str], None] = log) -> dict:
    """Runs the export; returns the manifest written next to the model.

    Raises:
      ExportError, WorkdirError, FileNotFoundError, StepSpecError, CheckpointIntegrityError:
        with a message that names the fix.
    """
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import runner

    _check_options(o)
    run_config, vocab = runner.open_workdir(o.workdir, o.step)
    cfg = run_config.model
    engine = _check_engine(o, run_config)
    data = run_config.data
    rows = max(o.max_positions, data.max_source_len + 1, data.max_target_len + 1)
    params, _ = restore.restore_params(o.workdir, o.step, average=o.average, log=log)
    step = restore.resolve_step(o.workdir, o.step) if o.average == 1 else o.step
    layout = model_layout(params, cfg, position_rows=rows)
    spm_files = _spm_files(o.workdir, vocab)
    pieces = (_pieces(vocab.source), _pieces(vocab.target))

    parent = os.path.dirname(os.path.abspath(o.out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        _save_model(o, layout, spm_files, pieces, staging, rows)
        pairs, difference, manifest_extra = _check_parity(
            o, run_config, params, layout, pieces, staging, vocab, log
        )
        manifest = {
            "workdir": os.path.abspath(o.workdir),
            "step": step,
            "average": o.average,
            "engine": o.to,
            "quantization": o.quantization,
            "position_rows": rows,
            "probe_pairs": len(pairs),
            "max_logprob_difference": difference,
            **manifest_extra,
        }
        _publish(staging, o.out, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(
        f"wrote {engine} model ({o.quantization}) of {o.workdir} step {step} to {o.out}; "
        f"{len(pairs)} probe pairs: max |log p difference| = {difference:.2e}"
    )
    return manifest


def _save_model(o: Options, layout, spm_files, pieces, staging: str, rows: int) -> None:
    """Writes the `o.to` engine's model of `layout` into `staging`, with the SentencePiece
    model(s) it tokenizes with; `rows`: the position table's."""
    from flaxformer_lite.export import to_ctranslate2, to_huggingface

    if o.to == "ctranslate2":
        to_ctranslate2.save(layout, *pieces, staging, o.quantization, o.int8_weight_bits)
        for path in dict.fromkeys(spm_files):  # the SentencePiece model(s), as trained
            shutil.copy2(path, os.path.join(staging, os.path.basename(path)))
    else:  # the tokenizer it saves holds the SentencePiece models (source/target.spm)
        to_huggingface.save(layout, spm_files, pieces, staging, rows)


def _publish(staging: str, out: str, manifest: dict) -> None:
    """Writes the manifest into the checked model directory `staging` and renames it to `out`
    (an empty directory there, checked by `_check_options`, is replaced)."""
    with open(os.path.join(staging, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    if os.path.isdir(out):
        os.rmdir(out)  # empty, checked above
    os.rename(staging, out)
