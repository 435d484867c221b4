"""A `ModelLayout` as a Hugging Face `MarianMTModel` directory (`pip install '.[export]'`).

Marian is the Transformers model with our architecture (post-LN, biases everywhere,
sqrt(d_model)-scaled embeddings, sinusoidal positions from 0, a tied or separate
output projection plus `final_logits_bias`), with three differences handled here:

* Its sinusoid table is rebuilt on load with sin in the first half of the dimensions
  and cos in the second (ours interleaves them, `nn/embeddings.sinusoidal_positions`).
  Every weight is therefore exported with the model dimension permuted, our dimension
  2i to i and 2i+1 to D/2 + i. LayerNorm, residuals and dot products do not care about
  the order of dimensions, so the permuted model computes the same logits; the table
  Marian builds is checked against ours, permuted, before anything is written.
* Its LayerNorm epsilon is fixed at 1e-5, and it is post-LN only, without learned
  positions or d_kv: a model that differs is refused with one line naming the field.
* Separate vocabularies of different sizes are padded to one size (4.57 cannot load
  them otherwise): padded source rows are never looked up, padded target entries get
  a logit bias of -1e9, so their probability is exactly 0.

The tokenizer saved beside it is a `MarianTokenizer` over the workdir's SentencePiece
model(s) with the same ids. Letter legend as in `layout.py`.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.constants import BOS_ID, EOS_ID, PAD_ID
from flaxformer_lite.export.layout import Attention, ExportError, Linear, ModelLayout, Norm
from flaxformer_lite.nn.vocab import PADDED_LOGIT

MARIAN_EPSILON = 1e-5
ACTIVATIONS = {"relu": "relu", "gelu": "gelu_new"}  # flax's nn.gelu is the tanh approximation


def require():
    """(torch, transformers), or an ExportError that says how to install them."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ExportError(
            "exporting to Hugging Face needs torch and transformers: pip install -e '.[export]'"
        ) from None
    return torch, transformers


def check_representable(cfg: TransformerConfig) -> None:
    """Refuses, in one line naming the field, a model MarianMTModel cannot compute."""
    why = None
    if cfg.norm != "post":
        why = f"model.norm={cfg.norm!r}: MarianMTModel is post-LN only"
    elif cfg.positions != "sinusoidal":
        why = f"model.positions={cfg.positions!r}: MarianMTModel has sinusoidal positions only"
    elif cfg.layer_norm_epsilon != MARIAN_EPSILON:
        why = (
            f"model.layer_norm_epsilon={cfg.layer_norm_epsilon:g}: MarianMTModel's LayerNorm "
            f"epsilon is fixed at {MARIAN_EPSILON:g}"
        )
    elif cfg.d_kv is not None and cfg.d_kv * cfg.num_heads != cfg.d_model:
        why = f"model.d_kv={cfg.d_kv}: MarianMTModel's heads split d_model evenly"
    elif cfg.d_model % 2:
        why = f"model.d_model={cfg.d_model}: an odd size has no sin/cos halves"
    if why:
        raise ExportError(
            f"cannot export to Hugging Face: {why}; export with --to ctranslate2 instead"
        )


def dimension_order(d_model: int) -> np.ndarray:
    """int[D]: Marian's dimension j holds our dimension order[j] (sines, then cosines)."""
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def _pad_rows(x: np.ndarray, rows: int, value: float = 0.0) -> np.ndarray:
    return np.concatenate([x, np.full((rows - len(x), *x.shape[1:]), value, x.dtype)])


def _state_dict(layout: ModelLayout, vocab: int) -> dict[str, np.ndarray]:
    """MarianMTModel's parameter names -> arrays, model dimension permuted, vocab padded."""
    p = dimension_order(layout.config.d_model)
    out: dict[str, np.ndarray] = {}

    def linear(name: str, lin: Linear, rows_are_d: bool, cols_are_d: bool) -> None:
        w = lin.weight[p] if rows_are_d else lin.weight
        out[f"{name}.weight"] = w[:, p] if cols_are_d else w
        if lin.bias is not None:
            out[f"{name}.bias"] = lin.bias[p] if rows_are_d else lin.bias

    def norm(name: str, n: Norm) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = n.scale[p], n.bias[p]

    def attention(name: str, a: Attention) -> None:
        for proj, lin in (("q_proj", a.q), ("k_proj", a.k), ("v_proj", a.v)):
            linear(f"{name}.{proj}", lin, rows_are_d=False, cols_are_d=True)
        linear(f"{name}.out_proj", a.out, rows_are_d=True, cols_are_d=False)

    for side, stack in (("encoder", layout.encoder), ("decoder", layout.decoder)):
        out[f"model.{side}.embed_tokens.weight"] = _pad_rows(stack.embedding, vocab)[:, p]
        for i, layer in enumerate(stack.layers):
            name = f"model.{side}.layers.{i}"
            attention(f"{name}.self_attn", layer.self_attention)
            norm(f"{name}.self_attn_layer_norm", layer.self_attention.norm)
            if layer.cross_attention is not None:
                attention(f"{name}.encoder_attn", layer.cross_attention)
                norm(f"{name}.encoder_attn_layer_norm", layer.cross_attention.norm)
            linear(f"{name}.fc1", layer.ffn_in, rows_are_d=False, cols_are_d=True)
            linear(f"{name}.fc2", layer.ffn_out, rows_are_d=True, cols_are_d=False)
            norm(f"{name}.final_layer_norm", layer.ffn_norm)
    out["model.shared.weight"] = out["model.decoder.embed_tokens.weight"]
    out["lm_head.weight"] = _pad_rows(layout.output.weight, vocab)[:, p]
    real = len(layout.output.weight)
    bias = np.zeros(real, np.float32) if layout.output.bias is None else layout.output.bias
    out["final_logits_bias"] = _pad_rows(bias, vocab, PADDED_LOGIT)[None, :]
    return out


def marian_config(layout: ModelLayout, vocab: int, max_positions: int):
    """The `MarianConfig` of `layout` (ids as ours: PAD 0, BOS 2 starts, EOS 3 ends)."""
    _, transformers = require()
    cfg = layout.config
    return transformers.MarianConfig(
        vocab_size=vocab,
        decoder_vocab_size=vocab,
        d_model=cfg.d_model,
        encoder_layers=cfg.num_encoder_layers,
        decoder_layers=cfg.num_decoder_layers,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=ACTIVATIONS[cfg.activation],
        max_position_embeddings=max_positions,
        scale_embedding=True,
        share_encoder_decoder_embeddings=layout.shared_embedding,
        tie_word_embeddings=cfg.tie_output_embedding,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )


def _check_positions(model, d_model: int) -> None:
    """Marian's rebuilt sinusoid table must be ours with the dimensions permuted."""
    from flaxformer_lite.export.layout import sinusoid_table

    table = model.model.encoder.embed_positions.weight.detach().numpy()
    ours = sinusoid_table(len(table), d_model)[:, dimension_order(d_model)]
    if not np.allclose(table, ours, atol=1e-4):
        raise ExportError(
            "this transformers version builds another sinusoid table than MarianMTModel's "
            "sin/cos halves; export with --to ctranslate2 instead"
        )


def build_model(layout: ModelLayout, max_positions: int = 1024):
    """A `MarianMTModel` (eval mode) holding `layout`'s weights."""
    check_representable(layout.config)
    torch, transformers = require()
    vocab = max(len(layout.encoder.embedding), len(layout.decoder.embedding))
    model = transformers.MarianMTModel(marian_config(layout, vocab, max_positions)).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in _state_dict(layout, vocab).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("embed_positions.weight")]
    if missing or unexpected:
        raise ExportError(
            f"MarianMTModel's parameters differ: missing {missing}, extra {unexpected}"
        )
    _check_positions(model, layout.config.d_model)
    return model


def _vocab_json(pieces: list[str], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({piece: i for i, piece in enumerate(pieces)}, f, ensure_ascii=False, indent=0)


def save(
    layout: ModelLayout,
    spm_files: tuple[str, str],
    pieces: tuple[list[str], list[str]],
    out_dir: str,
    max_positions: int = 1024,
) -> None:
    """Writes model (safetensors, config.json, generation_config.json) and tokenizer.

    Args:
      spm_files: the (source, target) SentencePiece model files (the same file twice when
        the vocabulary is shared).
      pieces: the (source, target) pieces in id order.
    """
    _, transformers = require()
    model = build_model(layout, max_positions)
    model.generation_config.update(
        decoder_start_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=None,
        bad_words_ids=None,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    separate = spm_files[0] != spm_files[1]
    tmp = os.path.join(out_dir, "tokenizer_sources")
    os.makedirs(tmp, exist_ok=True)
    _vocab_json(pieces[0], os.path.join(tmp, "vocab.json"))
    if separate:
        _vocab_json(pieces[1], os.path.join(tmp, "target_vocab.json"))
    with warnings.catch_warnings():  # "Recommended: pip install sacremoses" (not used here)
        warnings.simplefilter("ignore")
        tokenizer = transformers.MarianTokenizer(
            source_spm=spm_files[0],
            target_spm=spm_files[1],
            vocab=os.path.join(tmp, "vocab.json"),
            target_vocab_file=os.path.join(tmp, "target_vocab.json") if separate else None,
            separate_vocabs=separate,
            unk_token="<unk>",
            eos_token="</s>",
            pad_token="<pad>",
            model_max_length=max_positions,
        )
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(tmp):
        os.remove(os.path.join(tmp, name))
    os.rmdir(tmp)
