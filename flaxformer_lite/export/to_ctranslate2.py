"""A `ModelLayout` as a CTranslate2 Transformer model directory (`pip install '.[export]'`).

CTranslate2 runs the same architecture: embeddings scaled by sqrt(d_model) plus a
position table, post- or pre-LN layers with each LayerNorm attached to its sub-layer,
fused Q/K/V (self-attention) and K/V (cross-attention) projections, and a decoder
projection. What is set explicitly, because CTranslate2's defaults differ from ours:

* `layer_norm_epsilon` (CTranslate2's default is 1e-5, ours 1e-6);
* the position table (its built-in sinusoid puts sin and cos in halves and starts at
  position 1; ours interleaves them and starts at 0): ours is passed as an array;
* `add_source_eos` (our sources end in EOS) and `decoder_start_token` "<s>" (BOS_ID);
* gelu as `GELUTanh` (flax's `nn.gelu` is the tanh approximation).

The vocabularies are the SentencePiece pieces in id order, so CTranslate2's token ids
are ours. `optimize(quantization=...)` quantizes the weights (e.g. "int8") as saved.
"""

from __future__ import annotations

import numpy as np

from flaxformer_lite.export.layout import Attention, ExportError, Layer, ModelLayout, Norm, Stack

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16")


def require():
    """CTranslate2's spec modules, or an ExportError that says how to install them."""
    try:
        import ctranslate2  # noqa: F401
        from ctranslate2.specs import common_spec, transformer_spec
    except ImportError:
        raise ExportError(
            "exporting to CTranslate2 needs the ctranslate2 package: pip install -e '.[export]'"
        ) from None
    return common_spec, transformer_spec


def _norm(spec, norm: Norm) -> None:
    spec.gamma, spec.beta = np.array(norm.scale), np.array(norm.bias)


def _linear(spec, weight: np.ndarray, bias: np.ndarray | None) -> None:
    # Copies: quantization rewrites the arrays in place, and a checkpoint's are read-only.
    spec.weight = np.array(weight, np.float32)
    if bias is not None:
        spec.bias = np.array(bias, np.float32)


def _attention(spec, a: Attention, self_attention: bool) -> None:
    if self_attention:  # linear[0] = [Q; K; V], linear[1] = W_O
        qkv = (a.q, a.k, a.v)
        _linear(
            spec.linear[0],
            np.concatenate([x.weight for x in qkv]),
            np.concatenate([x.bias for x in qkv]),
        )
    else:  # linear[0] = Q, linear[1] = [K; V], linear[2] = W_O
        _linear(spec.linear[0], a.q.weight, a.q.bias)
        _linear(
            spec.linear[1],
            np.concatenate([a.k.weight, a.v.weight]),
            np.concatenate([a.k.bias, a.v.bias]),
        )
    _linear(spec.linear[-1], a.out.weight, a.out.bias)
    _norm(spec.layer_norm, a.norm)


def _layer(spec, layer: Layer) -> None:
    _attention(spec.self_attention, layer.self_attention, True)
    if layer.cross_attention is not None:
        _attention(spec.attention, layer.cross_attention, False)
    _linear(spec.ffn.linear_0, layer.ffn_in.weight, layer.ffn_in.bias)
    _linear(spec.ffn.linear_1, layer.ffn_out.weight, layer.ffn_out.bias)
    _norm(spec.ffn.layer_norm, layer.ffn_norm)


def _stack(spec, stack: Stack, d_model: int, rows: int) -> None:
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = np.array(stack.embedding, np.float32)
    spec.scale_embeddings = True  # x sqrt(d_model), as `nn/embeddings.Embed`
    # No positions ("none") is a table of zeros: CTranslate2's encoder always adds one.
    table = stack.positions if stack.positions is not None else np.zeros((rows, d_model))
    spec.position_encodings.encodings = np.array(table, np.float32)
    for layer_spec, layer in zip(spec.layer, stack.layers, strict=True):
        _layer(layer_spec, layer)
    if stack.final_norm is not None:
        _norm(spec.layer_norm, stack.final_norm)


def build_spec(layout: ModelLayout, source_pieces: list[str], target_pieces: list[str]):
    """The CTranslate2 `TransformerSpec` of `layout`, vocabularies registered, not yet saved."""
    common_spec, transformer_spec = require()
    cfg = layout.config
    pre = cfg.norm == "pre"
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELUTanh}
    options = dict(pre_norm=pre, activation=activation[cfg.activation])
    if cfg.d_kv is not None:
        options["head_dim"] = cfg.head_dim
    encoder = transformer_spec.TransformerEncoderSpec(
        cfg.num_encoder_layers, cfg.num_heads, **options
    )
    decoder = transformer_spec.TransformerDecoderSpec(
        cfg.num_decoder_layers, cfg.num_heads, **options
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    rows = len(layout.encoder.positions) if layout.encoder.positions is not None else 1024
    _stack(spec.encoder, layout.encoder, cfg.d_model, rows)
    _stack(spec.decoder, layout.decoder, cfg.d_model, rows)
    _linear(spec.decoder.projection, layout.output.weight, layout.output.bias)
    spec.config.layer_norm_epsilon = float(cfg.layer_norm_epsilon)
    spec.config.add_source_eos = True
    spec.config.add_source_bos = False
    spec.config.decoder_start_token = "<s>"
    spec.register_source_vocabulary(list(source_pieces))
    spec.register_target_vocabulary(list(target_pieces))
    return spec


def save(
    layout: ModelLayout,
    source_pieces: list[str],
    target_pieces: list[str],
    out_dir: str,
    quantization: str = "float32",
    int8_weight_bits: int = 8,
) -> None:
    """Writes the CTranslate2 model (model.bin, config.json, vocabularies) into `out_dir`.

    `int8_weight_bits=7` (int8 quantizations only) keeps every int8 weight within
    [-63, 63], so CPUs without VNNI do not saturate (`int8_check.py`).
    """
    if quantization not in QUANTIZATIONS:
        raise ExportError(
            f"--quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
        )
    spec = build_spec(layout, source_pieces, target_pieces)
    spec.validate()
    if int8_weight_bits != 8 and quantization in ("int8", "int8_float32"):
        from flaxformer_lite.export.int8_check import quantize_weights

        spec.optimize(quantization=None)  # aliases shared weights, converts nothing
        quantize_weights(spec, int8_weight_bits)
    else:
        spec.optimize(quantization=None if quantization == "float32" else quantization)
    spec.save(out_dir)
