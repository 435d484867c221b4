"""What decoding reports besides its output: BLEU / chrF, attention plots, warnings, speed."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.bleu import corpus_scores, tokenized_bleu
from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.data.extended_ids import ExtendedVocabulary
from flaxformer_lite.data.tokenizer import Tokenizer, Vocabularies
from flaxformer_lite.translate.line_io import InputError


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
    check_line_counts(len(hypotheses), len(references))
    return corpus_scores(hypotheses, references).report


def tokenized_bleu_line(
    hypotheses: Sequence[str],
    references: Sequence[str],
    lang: str,
    *,
    lowercase: bool = True,
    note: str = "",
) -> str:
    """The BLEU4 that Multi30k papers publish (`bleu.tokenized_bleu`) in fairseq's format,
    followed by its preprocessing as sacreBLEU's score is by its signature, and `note`.

    It starts "tokenized BLEU4", so that the line of sacreBLEU's BLEU is still the one
    that starts "BLEU|".
    """
    check_line_counts(len(hypotheses), len(references))
    out = tokenized_bleu(hypotheses, references, lang, lowercase=lowercase)
    return f"tokenized {out.format()} | {out.description}{note}"


def reference_lines(
    result, references: Sequence[str], run_config, tokenizer, bleu_lang: str, lowercase: bool
) -> list[str]:
    """What `decode.py --reference` reports: sacreBLEU and chrF, the tokenized BLEU4, the
    word error rate of a speech run, and the multi-modality shares."""
    from flaxformer_lite.data.tokenizer import Vocabularies
    from flaxformer_lite.translate import input_lines

    lang, note = resolve_bleu_lang(bleu_lang, run_config)
    lines = [
        bleu_report(result.texts, references),
        tokenized_bleu_line(result.texts, references, lang, lowercase=lowercase, note=note),
    ]
    if input_lines.is_speech(run_config):
        lines.append(speech_report(result.texts, references))
    lines.append(multimodality_line(result, references, Vocabularies.of(tokenizer).target))
    return lines


def resolve_bleu_lang(requested: str, run_config) -> tuple[str, str]:
    """The language of the tokenized BLEU's Moses rules (`requested`, else the run's
    data.target_lang, else English), and a note for the line when it was assumed."""
    if requested:
        return requested, ""
    if run_config.data.target_lang:
        return run_config.data.target_lang, ""
    return "en", " (lang en assumed: the run config names no data.target_lang; set --bleu_lang)"


def multimodality_line(result, references: Sequence[str], target_vocab) -> str:
    """`multimodality_of` as one line of decode.py's report."""
    return multimodality_of(result, references, target_vocab).line()


def multimodality_of(result, references: Sequence[str], target_vocab):
    """Repeated tokens and wrong lengths of the 1-best outputs (`evaluation/multimodality.py`),
    over the lines with a source. Outputs are compared as text, encoded as the references
    are: the pieces a model emits may segment the same text differently."""
    from flaxformer_lite.evaluation import multimodality

    live = [i for i, ids in enumerate(result.sources.ids) if len(ids)]  # ids or frames
    outputs = [target_vocab.encode(result.texts[i]) for i in live]
    refs = [target_vocab.encode(references[i]) for i in live]
    return multimodality.measure(outputs, refs)


def input_warnings(num_invalid_utf8: int, sources, max_source_len: int) -> list[str]:
    """One line per kind of bad input, with its count of lines.

    `num_invalid_utf8`: lines with invalid UTF-8 or NUL bytes (`line_io.read_lines`).
    `sources`: a `bucketing.Sources` (its num_truncated and num_unknown counts).
    """
    out = []
    if num_invalid_utf8:
        out.append(
            f"warning: {num_invalid_utf8} line(s) had invalid UTF-8 or NUL bytes, "
            "replaced by U+FFFD"
        )
    if sources.num_truncated:
        out.append(
            f"warning: {sources.num_truncated} line(s) longer than {max_source_len} source "
            "tokens were truncated (--strict refuses them)"
        )
    if sources.num_unknown:
        how = "the copy head can copy them" if sources.oov is not None else "decoded as <unk>"
        out.append(
            f"warning: {sources.num_unknown} line(s) contain characters unknown to the "
            f"vocabulary ({how})"
        )
    return out


def summary(result) -> str:
    """Lines decoded, speed, and the number of batch shapes (compilations) of a DecodeResult."""
    lines, empty = len(result.hypotheses), result.sources.num_empty
    seconds = max(result.seconds, 1e-9)
    return (
        f"decoded {lines - empty} of {lines} line(s) ({empty} empty) in {result.seconds:.1f}s: "
        f"{(lines - empty) / seconds:.1f} sentences/s, "
        f"{result.num_output_tokens / seconds:.0f} tokens/s, "
        f"{len(result.batch_shapes)} batch shape(s)"
    )


def check_attention_layer(layer: int, num_layers: int) -> None:
    """Raises InputError unless `layer` indexes one of `num_layers` decoder layers."""
    if not -num_layers <= layer < num_layers:
        raise InputError(f"--attention_layer {layer} is out of range for {num_layers} layer(s)")


def _cross_attention(model, params, source_ids, output_ids, layer: int):
    """Teacher-forced cross-attention of one decoder layer float32[B, N, T, S], and with a
    copy head its p_gen float32[B, T] (else None)."""
    import jax

    src_len = max(len(s) for s in source_ids)
    tgt_len = max(len(o) for o in output_ids)
    extra = {}
    if _is_features(source_ids):  # speech frames float32[K, F] per line
        inputs = np.zeros((len(source_ids), src_len, np.shape(source_ids[0])[1]), np.float32)
        valid = np.zeros((len(source_ids), src_len), bool)  # [B, S]
        for row, src in enumerate(source_ids):
            inputs[row, : len(src)], valid[row, : len(src)] = src, True
        extra["inputs_valid"] = valid
    else:
        inputs = np.full((len(source_ids), src_len), PAD_ID, np.int32)  # [B, S]
        for row, src in enumerate(source_ids):
            inputs[row, : len(src)] = src

    name = f"decoder/cross/{layer}"
    # Row t of the targets is output[t]: the model's teacher-forced input is BOS + output[:t].
    targets = np.full((len(source_ids), tgt_len), PAD_ID, np.int32)  # [B, T]
    for row, out in enumerate(output_ids):
        targets[row, : len(out)] = out

    copy_head = getattr(model, "copy", None) is not None

    def weights_fn(params, inputs, targets, extra):
        batch = {"inputs": inputs, "targets": targets, **extra}
        weights = model.attention_weights(params, batch, (name,))[name]  # float32[B, N, T, S]
        return weights, model.copy_gate(params, batch) if copy_head else None

    weights, gate = jax.jit(weights_fn)(params, inputs, targets, extra)
    return np.asarray(weights), None if gate is None else np.asarray(gate)


def _is_features(source_ids) -> bool:
    """Whether the inputs are speech frames (float32[K, F] per line) rather than token ids."""
    return any(np.ndim(s) == 2 for s in source_ids)


def _frame_labels(model, frames: int) -> list[str]:
    """x labels of a speech input's encoder positions: the start time in ms of every fifth
    position (after the front end's subsampling), blank in between."""
    from flaxformer_lite.data.audio_features import HOP_MS
    from flaxformer_lite.nn.subsampling import subsampled_lengths

    cfg = model.config
    positions = int(subsampled_lengths(frames, cfg))
    step_ms = HOP_MS * frames / max(positions, 1)
    return [f"{round(t * step_ms)}" if t % 5 == 0 else "" for t in range(positions)]


def _plot(
    weights: np.ndarray,
    src: list[str],
    out: list[str],
    title: str,
    path: str,
    gate: np.ndarray | None = None,
) -> None:
    """One PNG of float32[N, >= len(out), >= len(src)] weights, one panel per head; with
    `gate` (a copy head's p_gen float32[>= len(out)]) a first, narrow panel shows it per
    output token (1: generated from the vocabulary, 0: copied)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    heads = weights.shape[0]
    # Capped so that long sentences still give a figure within matplotlib's pixel limits.
    width = heads * (1.0 + min(0.3 * len(src), 12.0)) + (1.2 if gate is not None else 0.0)
    fig = Figure(figsize=(width, 1.5 + min(0.3 * len(out), 30.0)))
    panels = heads + (gate is not None)
    ratios = ([0.12 * max(len(src), 1)] if gate is not None else []) + [len(src) or 1] * heads
    axes = list(fig.subplots(1, panels, squeeze=False, width_ratios=ratios)[0])
    if gate is not None:
        ax = axes.pop(0)
        ax.imshow(gate[: len(out), None], cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
        for t in range(len(out)):
            ax.text(0, t, f"{gate[t]:.2f}", ha="center", va="center", fontsize=7, color="cyan")
        ax.set_xticks([0], ["p_gen"], fontsize=8)
        ax.set_yticks(range(len(out)), out, fontsize=8)
        ax.set_title("copy gate", fontsize=9)
    for h, ax in enumerate(axes):
        ax.imshow(weights[h, : len(out), : len(src)], cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(src)), src, rotation=90, fontsize=8)
        ax.set_yticks(range(len(out)), out if h == 0 and gate is None else [], fontsize=8)
        ax.set_title(f"head {h}", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


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
    oov: Sequence[Sequence[str]] | None = None,
) -> list[str]:
    """Plots the cross-attention of the first `count` non-empty inputs, one PNG each; for a
    copy head, with its p_gen per output token beside the heads.

    Args:
      source_ids: per input line, source ids ending in EOS ([] = empty line, skipped), or
        for a speech workdir its frames float32[K, F] (x = encoder positions, labelled in ms).
      output_ids: per input line, the generated ids (EOS included).
      layer: decoder layer (negative counts from the last).
      oov: per input line, its unknown pieces (`Sources.oov`), which label extended ids.
    Returns:
      Paths written: `out_dir/attention_<line index, 0-based, 4 digits>.png`,
      one panel per head, x = source pieces, y = output pieces.
    """
    num_layers = model.config.num_decoder_layers
    check_attention_layer(layer, num_layers)
    pairs = enumerate(zip(source_ids, output_ids))
    chosen = [i for i, (s, o) in pairs if len(s) and len(o)][:count]  # frames are arrays
    if not chosen:
        return []
    os.makedirs(out_dir, exist_ok=True)
    weights, gate = _cross_attention(
        model, params, [source_ids[i] for i in chosen], [output_ids[i] for i in chosen], layer
    )
    vocab = Vocabularies.of(tokenizer)
    source_pieces, target_pieces = vocab.source.id_to_piece, vocab.target.id_to_piece
    if oov is not None:
        source_pieces = ExtendedVocabulary(vocab.source).piece
        target_pieces = ExtendedVocabulary(vocab.target).piece
    paths = []
    for row, i in enumerate(chosen):
        unknown = () if oov is None else (oov[i],)
        if _is_features(source_ids):
            src = _frame_labels(model, len(source_ids[i]))  # encoder positions, in ms
        else:
            src = [source_pieces(t, *unknown) for t in source_ids[i]]
        out = [target_pieces(t, *unknown) for t in output_ids[i]]
        title = f"line {i}: decoder layer {layer % num_layers} cross-attention"
        path = os.path.join(out_dir, f"attention_{i:04d}.png")
        _plot(weights[row], src, out, title, path, None if gate is None else gate[row])
        paths.append(path)
    return paths


def speech_report(hypotheses: list[str], references: list[str]) -> str:
    """The word error rate and exact match of a speech workdir's output, one line."""
    from flaxformer_lite.evaluation.word_errors import word_error_rate

    exact = sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)
    wer = word_error_rate(hypotheses, references)
    return f"WER = {100 * wer:.2f}% exact_match = {exact:.4f} over {len(references)} line(s)"
