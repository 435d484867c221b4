"""Per-token log-probabilities of the same (source, target) pairs from our model and from
an exported one, to show they are the same model.

Each function takes id lists without EOS (`Tokenizer.encode`) and returns one float32
array per pair: log p(target token | source, prefix) for every target token and the final
EOS, the quantity `Seq2SeqModel.score` computes. CTranslate2's come from
`Translator.score_batch`, Marian's from its teacher-forced logits (the first V_target
entries: padded entries are not real tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flaxformer_lite.constants import BOS_ID, EOS_ID


def padded(rows: Sequence[Sequence[int]], length: int | None = None) -> np.ndarray:
    """int32[len(rows), length] with row i's ids first, then PAD_ID (0); length defaults to
    the longest row."""
    length = length or max(len(r) for r in rows)
    out = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def ours(model, params, sources: Sequence[list[int]], targets: Sequence[list[int]]):
    """`model.score` of the pairs (EOS appended to both sides, as in training)."""
    import jax

    batch = {
        "inputs": padded([[*s, EOS_ID] for s in sources]),
        "targets": padded([[*t, EOS_ID] for t in targets]),
    }
    token_logp, _ = jax.jit(model.score)(params, batch)
    token_logp = np.asarray(token_logp)
    return [token_logp[i, : len(t) + 1] for i, t in enumerate(targets)]


def ctranslate2_scores(translator, source_pieces, target_pieces, source_ids, target_ids):
    """`Translator.score_batch` (it appends EOS to both sides itself) as arrays."""
    del source_ids, target_ids  # CTranslate2 reads pieces
    results = translator.score_batch(
        [list(p) for p in source_pieces], [list(p) for p in target_pieces]
    )
    return [np.asarray(r.log_probs, np.float32) for r in results]


def marian_scores(model, sources: Sequence[list[int]], targets: Sequence[list[int]]):
    """Teacher-forced log-probabilities of a `MarianMTModel`, over the real target vocabulary.

    Returns:
      (per-pair token log-probs, per-pair logits float32[T + 1, V_model]).
    """
    import torch

    inputs = padded([[*s, EOS_ID] for s in sources])
    decoder_inputs = padded([[BOS_ID, *t] for t in targets])
    with torch.no_grad():
        logits = model(
            input_ids=torch.from_numpy(inputs).long(),
            attention_mask=torch.from_numpy(inputs != 0).long(),
            decoder_input_ids=torch.from_numpy(decoder_inputs).long(),
        ).logits.numpy()
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    scores, rows = [], []
    for i, t in enumerate(targets):
        gold = [*t, EOS_ID]
        scores.append(logp[i, np.arange(len(gold)), gold].astype(np.float32))
        rows.append(logits[i, : len(gold)])
    return scores, rows


def max_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest |a - b| over all pairs' token log-probs (inf if the lengths differ)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, float(np.max(np.abs(x - y)))) if x.size else worst
    return worst
