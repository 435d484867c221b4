"""`bench.py --compare ctranslate2`: our decoding against CTranslate2 on the same weights.

The weights are exported once (`export/to_ctranslate2.py`) as float32 and as int8; the
three engines (ours in float32 through `Seq2SeqModel.predict`, CTranslate2 float32,
CTranslate2 int8) then decode the same sources: greedy and beam search, at each batch
size, every search made to run exactly `new_tokens` steps (EOS forbidden before, as in
`decoding.py`). After one warm-up call each (ours compiles there), the runs are
interleaved round by round, so a slower or busier stretch of the machine hits every
engine alike, and the median of the rounds is reported. CTranslate2 runs with
`intra_threads` = every core, as XLA:CPU does.

With a trained workdir and a source/reference file pair, `file_bleu` decodes the whole
file with each engine and scores sacreBLEU, and counts the lines on which the engines'
outputs are identical to ours.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from flaxformer_lite.constants import EOS_ID
from flaxformer_lite.export import layout as layout_lib
from flaxformer_lite.export import to_ctranslate2
from flaxformer_lite.models import predict

ENGINES = ("ours_fp32", "ct2_fp32", "ct2_int8")


def synthetic_pieces(size: int) -> list[str]:
    """Reserved pieces then one made-up piece per id (the timing needs no real vocabulary)."""
    return ["<pad>", "<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(4, size)]


def export_pair(params, config, source_pieces, target_pieces, directory: str, rows: int):
    """CTranslate2 float32 and int8 models of `params` in `directory`: {"fp32"|"int8": path}."""
    layout = layout_lib.model_layout(params, config, position_rows=rows)
    paths = {}
    for name, quantization in (("fp32", "float32"), ("int8", "int8")):
        paths[name] = os.path.join(directory, name)
        os.makedirs(paths[name])
        to_ctranslate2.save(layout, source_pieces, target_pieces, paths[name], quantization)
    return paths


def translators(paths: dict[str, str], threads: int | None = None) -> dict:
    import ctranslate2

    threads = threads or os.cpu_count() or 1
    return {
        f"ct2_{name}": ctranslate2.Translator(
            path,
            device="cpu",
            compute_type="float32" if name == "fp32" else "int8",
            intra_threads=threads,
        )
        for name, path in paths.items()
    }


def _median_rounds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Warm each run up, then time them interleaved for `repeats` rounds: median seconds."""
    for fn in runs.values():
        jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def compare_decode_benchmark(
    config,
    *,
    batch_sizes: tuple[int, ...] = (1, 16, 32),
    source_len: int = 64,
    new_tokens: int = 64,
    beam_size: int = 4,
    repeats: int = 5,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Tokens/s of the three engines on random weights of `config`, same sources.

    Sources are `source_len - 1` random ordinary ids plus EOS (CTranslate2 appends the
    EOS itself). Returns {"rows": [{"batch", "search", "<engine>_s",
    "<engine>_tokens_per_s", "ct2_fp32_over_ours", "ct2_int8_over_ours"}], ...}.
    """
    model, params = _random_model(config, source_len)
    pieces = synthetic_pieces(config.vocab_size)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, config.vocab_size, (max(batch_sizes), source_len - 1))
    with tempfile.TemporaryDirectory() as tmp:
        paths = export_pair(params, config, pieces, pieces, tmp, max(1024, 2 * new_tokens))
        engines = translators(paths, threads)
        rows = []
        for search in ("greedy", f"beam{beam_size}"):
            k = 1 if search == "greedy" else beam_size
            cfg = predict.SearchConfig(
                "greedy" if k == 1 else "beam", new_tokens, min_len=new_tokens, beam_size=k
            )
            fn = jax.jit(lambda p, x, cfg=cfg: model.predict(p, {"inputs": x}, cfg))
            for batch in batch_sizes:
                runs = _engine_runs(fn, params, engines, ids[:batch], pieces, k, new_tokens)
                row = {"batch": batch, "search": search}
                row.update(_speeds(_median_rounds(runs, repeats), batch * new_tokens))
                rows.append(row)
                log(_row_line(row))
    return {"rows": rows, "threads": threads or os.cpu_count(), "repeats": repeats}


def _random_model(config, source_len: int):
    """(AutoregressiveModel of `config`, its parameters initialised with PRNGKey(0))."""
    import flax.linen as nn

    from flaxformer_lite.models.autoregressive import AutoregressiveModel

    model = AutoregressiveModel(config)
    shapes = {"inputs": (1, source_len), "targets": (1, 8)}
    params = jax.jit(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), shapes)))()
    return model, params


def _engine_runs(fn, params, engines: dict, ids: np.ndarray, pieces, k: int, new_tokens: int):
    """{engine: call} decoding the same sources `ids` int[B, S - 1] (+ EOS) with beam `k`
    (1: greedy), each made to run exactly `new_tokens` steps.

    `fn(params, inputs int32[B, S])`: our jitted predict; `engines`: the CTranslate2
    translators.

    Raises:
      RuntimeError: CTranslate2 did not decode exactly `new_tokens` tokens.
    """
    inputs = np.concatenate([ids, np.full((len(ids), 1), EOS_ID)], 1)
    inputs = jax.numpy.asarray(inputs, jax.numpy.int32)
    tokens = [[pieces[i] for i in row] for row in ids.tolist()]
    runs = {"ours_fp32": lambda x=inputs: fn(params, x)}
    for name, translator in engines.items():
        runs[name] = lambda t=translator, s=tokens, k=k: t.translate_batch(
            s,
            beam_size=k,
            min_decoding_length=new_tokens,
            max_decoding_length=new_tokens,
            length_penalty=0.0,
        )
    lengths = {len(r.hypotheses[0]) for r in runs["ct2_fp32"]()}
    if lengths != {new_tokens}:
        raise RuntimeError(f"CTranslate2 produced lengths {lengths}")
    return runs


def _speeds(seconds: dict[str, float], tokens: int) -> dict[str, float]:
    """A result row's timing fields: each engine's seconds and tokens/s for `tokens` decoded
    tokens, and CTranslate2's speed-ups over ours."""
    row = {}
    for name, s in seconds.items():
        row[f"{name}_s"] = s
        row[f"{name}_tokens_per_s"] = tokens / s
    for name in ENGINES[1:]:
        row[f"{name}_over_ours"] = seconds["ours_fp32"] / seconds[name]
    return row


HEADER = (
    "search   batch | ours fp32 tok/s | ct2 fp32 tok/s | ct2 int8 tok/s | ct2 fp32 / ours "
    "| ct2 int8 / ours"
)


def _row_line(row: dict) -> str:
    return (
        f"{row['search']:<8} {row['batch']:>5} | {row['ours_fp32_tokens_per_s']:15.1f} | "
        f"{row['ct2_fp32_tokens_per_s']:14.1f} | {row['ct2_int8_tokens_per_s']:14.1f} | "
        f"{row['ct2_fp32_over_ours']:14.2f}x | {row['ct2_int8_over_ours']:14.2f}x"
    )


def _translate_file(translator, pieces, vocab, beam: int, batch_size: int, max_len: int):
    """(CTranslate2's output texts, warm seconds) for source `pieces`."""
    results, seconds = _warm_seconds(
        lambda: translator.translate_batch(
            pieces, beam_size=beam, max_batch_size=batch_size, max_decoding_length=max_len
        )
    )
    ids = [[vocab.target.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    return [vocab.target.decode(i) for i in ids], seconds


def _scores(search_name: str, outputs: dict, references, log) -> dict:
    """BLEU, seconds and the share of lines equal to ours, per engine."""
    from flaxformer_lite import bleu

    ours = outputs["ours_fp32"][0]
    results = {}
    for name, (texts, seconds) in outputs.items():
        score = bleu.corpus_scores(texts, references)
        same = sum(a == b for a, b in zip(texts, ours, strict=True)) / len(ours)
        results[f"{search_name}_{name}"] = {
            "bleu": score.bleu,
            "seconds": seconds,
            "same_as_ours": same,
        }
        log(
            f"{search_name:<6} {name:<9}: BLEU {score.bleu:5.2f}  {seconds:6.1f} s  "
            f"{same:.1%} of lines identical to ours"
        )
    return results


def _warm_seconds(fn: Callable[[], object]) -> tuple[object, float]:
    """fn's result and the seconds of its second call (the first compiles our searches)."""
    fn()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def file_bleu(
    workdir: str,
    input_path: str,
    reference_path: str,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_sizes: tuple[int, ...] = (32,),
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Decodes `input_path` with a workdir's model in the three engines: BLEU, seconds (of a
    second pass: the first compiles our searches, one per length bucket) and the share of
    lines identical to ours, greedy and beam (ours: GNMT penalty `alpha`; CTranslate2: its
    length normalisation, `length_penalty` 1), at each batch size. Ours twice: padded
    batches (`decode.py`'s default) and continuous batching in as many slots
    (`--batching continuous`)."""
    from flaxformer_lite.models import from_config
    from flaxformer_lite.training import restore
    from flaxformer_lite.translate import continuous, input_lines, line_io, runner

    run_config, vocab = runner.open_workdir(workdir)
    layout_lib.check_exportable(run_config, "CTranslate2")
    params, _ = restore.restore_params(workdir)
    model = from_config.build_model(run_config)
    lines, _ = line_io.read_lines(input_path)
    references, _ = line_io.read_lines(reference_path)
    max_len, max_source = run_config.data.max_target_len, run_config.data.max_source_len
    sources = input_lines.tokenize_lines(vocab, lines, max_source)
    pieces = [[vocab.source.id_to_piece(i) for i in vocab.source.encode(line)] for line in lines]
    pieces = [p[: max_source - 1] for p in pieces]  # ours keeps max_source_len ids with EOS
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = [vocab.source.id_to_piece(i) for i in range(vocab.source.vocab_size)]
        target = [vocab.target.id_to_piece(i) for i in range(vocab.target.vocab_size)]
        paths = export_pair(params, run_config.model, source, target, tmp, max(1024, max_len + 1))
        engines = translators(paths, threads)
        for batch, k in ((b, k) for b in batch_sizes for k in (1, beam_size)):
            search = runner.make_search(run_config, beam_size=k, alpha=alpha)
            padded = lambda search=search, batch=batch: (
                runner.decode_lines(
                    model, params, vocab, run_config, sources, search=search, batch_size=batch
                ).texts
            )
            slots = lambda search=search, batch=batch: (
                continuous.decode_lines(
                    model, params, vocab, run_config, sources, search=search, slots=batch
                ).texts
            )
            outputs = {"ours_fp32": _warm_seconds(padded), "ours_continuous": _warm_seconds(slots)}
            for name, translator in engines.items():
                outputs[name] = _translate_file(translator, pieces, vocab, k, batch, max_len)
            name = ("greedy" if k == 1 else f"beam{k}") + f"_batch{batch}"
            results.update(_scores(name, outputs, references, log))
    return results
