"""A trained model's parameters in the engine-neutral layout that every exporter reads.

Our checkpoints store the layers per layer (`layer_0`, `layer_1`, ...; a run trained
with `model.scan_layers` stores them stacked and is read layer by layer,
`models/layer_layout.py`), with kernels in flax's [in, out] order and attention
kernels split by head ([D, 3, N, H] for Q/K/V). Inference engines (CTranslate2,
PyTorch) store every linear map as `weight` [out, in] plus `bias` [out]. `model_layout`
converts once, to plain numpy:

  Linear(weight float32[out, in], bias float32[out] or None)
  Norm(scale float32[D], bias float32[D])
  Attention(q, k, v, out: Linear; norm: Norm)   q/k/v outputs are N * H, heads outermost
  Layer(self_attention, cross_attention or None, ffn_in, ffn_out: Linear; ffn_norm: Norm)
  Stack(embedding float32[V, D] (unscaled) or None, positions float32[P, D] or None,
        layers, final_norm: Norm or None (pre-LN))
  ModelLayout(encoder, decoder: Stack; output: Linear [V, D] (the tied embedding when
              tied); config: TransformerConfig)

A `Norm` belongs to the sub-layer it wraps: post-LN applies it to x + Sublayer(x),
pre-LN to the sub-layer's input (`nn/layers.Residual`), which is also how CTranslate2
and Marian attach their LayerNorms. `check_exportable` refuses, in one line naming the
field, what no plain encoder-decoder Transformer engine represents.

Letter legend as in `nn/attention.py` (D d_model, N heads, H head dim, F d_ff, V vocab,
P position-table rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.nn.vocab import real_rows


class ExportError(ValueError):
    """The model (or a flag) cannot be exported as asked; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Linear:
    weight: np.ndarray  # float32[out, in]
    bias: np.ndarray | None  # float32[out]


@dataclasses.dataclass(frozen=True)
class Norm:
    scale: np.ndarray  # float32[D]
    bias: np.ndarray  # float32[D]


@dataclasses.dataclass(frozen=True)
class Attention:
    q: Linear  # [N*H, D]
    k: Linear  # [N*H, D]
    v: Linear  # [N*H, D]
    out: Linear  # [D, N*H]
    norm: Norm  # the LayerNorm of this sub-layer's residual


@dataclasses.dataclass(frozen=True)
class Layer:
    self_attention: Attention
    cross_attention: Attention | None  # decoder layers only
    ffn_in: Linear  # [F, D]
    ffn_out: Linear  # [D, F]
    ffn_norm: Norm


@dataclasses.dataclass(frozen=True)
class Stack:
    embedding: np.ndarray | None  # float32[V, D], unscaled (the model multiplies by sqrt(D))
    positions: np.ndarray | None  # float32[P, D], row p added at position p; None: none
    layers: list[Layer]
    final_norm: Norm | None  # pre-LN only


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    config: TransformerConfig
    encoder: Stack
    decoder: Stack
    output: Linear  # float32[V_target, D] pre-softmax projection (+ bias when untied)

    @property
    def shared_embedding(self) -> bool:
        """Whether the encoder and decoder read one embedding matrix."""
        return self.encoder.embedding is self.decoder.embedding


def check_exportable(run_config: RunConfig, engine: str) -> None:
    """Refuses, with one line naming the field, what a plain Transformer engine cannot run."""
    cfg = run_config.model
    refusals = (
        (run_config.nat is not None, "the nat section (a non-autoregressive decoder)"),
        (run_config.copy is not None, "the copy section (a pointer-generator head)"),
        (cfg.input_features > 0, f"model.input_features={cfg.input_features} (feature inputs)"),
        (cfg.encoder_window > 0, f"model.encoder_window={cfg.encoder_window} (local attention)"),
        (cfg.decoder_window > 0, f"model.decoder_window={cfg.decoder_window} (local attention)"),
    )
    for refused, what in refusals:
        if refused:
            raise ExportError(
                f"{engine} runs a plain token-to-token Transformer; this workdir's run config "
                f"has {what}: decode it with decode.py instead"
            )


def sinusoid_table(rows: int, d_model: int) -> np.ndarray:
    """`nn/embeddings.sinusoidal_positions` for positions 0..rows-1: float32[rows, D]."""
    from flaxformer_lite.nn.embeddings import sinusoidal_positions

    return np.asarray(sinusoidal_positions(np.arange(rows), d_model), np.float32)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _linear(kernel: Any, bias: Any | None, in_dims: int = 1) -> Linear:
    """A flax kernel [*in, *out] (in_dims leading axes) -> Linear(weight [out, in])."""
    kernel = _np(kernel)
    k_in = int(np.prod(kernel.shape[:in_dims]))
    weight = kernel.reshape(k_in, -1).T
    return Linear(np.ascontiguousarray(weight), None if bias is None else _np(bias).reshape(-1))


def _norm(p: dict) -> Norm:
    return Norm(_np(p["norm"]["scale"]), _np(p["norm"]["bias"]))


def _attention(p: dict, residual: dict) -> Attention:
    if "qkv_kernel" in p:  # self-attention: [D, 3, N, H], [3, N, H]
        kernels = [p["qkv_kernel"][:, i] for i in range(3)]
        biases = [p["qkv_bias"][i] for i in range(3)]
    else:  # cross-attention: q [D, N, H]; k, v stacked [D, 2, N, H]
        kernels = [p["q_kernel"], p["kv_kernel"][:, 0], p["kv_kernel"][:, 1]]
        biases = [p["q_bias"], p["kv_bias"][0], p["kv_bias"][1]]
    q, k, v = (_linear(w, b) for w, b in zip(kernels, biases, strict=True))
    out = _linear(p["out_kernel"], p["out_bias"], in_dims=2)  # [N, H, D] -> [D, N*H]
    return Attention(q, k, v, out, _norm(residual))


def _layer(p: dict, decoder: bool) -> Layer:
    return Layer(
        self_attention=_attention(p["self_attention"], p["self_attention_residual"]),
        cross_attention=(
            _attention(p["cross_attention"], p["cross_attention_residual"]) if decoder else None
        ),
        ffn_in=_linear(p["ffn"]["wi"]["kernel"], p["ffn"]["wi"]["bias"]),
        ffn_out=_linear(p["ffn"]["wo"]["kernel"], p["ffn"]["wo"]["bias"]),
        ffn_norm=_norm(p["ffn_residual"]),
    )


def _positions(p: dict, cfg: TransformerConfig, rows: int) -> np.ndarray | None:
    if cfg.positions == "none":
        return None
    if cfg.positions == "learned":
        return _np(p["positions"]["pos_embedding"])  # [max_len, D]
    return sinusoid_table(rows, cfg.d_model)


def _stack(p: dict, cfg: TransformerConfig, embedding, num_layers: int, rows: int, decoder):
    final = p.get("final_norm")
    return Stack(
        embedding=embedding,
        positions=_positions(p, cfg, rows),
        layers=[_layer(p[f"layer_{i}"], decoder) for i in range(num_layers)],
        final_norm=None if final is None else Norm(_np(final["scale"]), _np(final["bias"])),
    )


def model_layout(params: dict, cfg: TransformerConfig, position_rows: int = 1024) -> ModelLayout:
    """The parameters of a token-input `models/transformer.Transformer` as a `ModelLayout`.

    Args:
      params: the nested parameter dict a checkpoint holds (`training/restore.restore_params`).
      position_rows: rows of the sinusoid tables (the longest source or output an engine may
        then run); learned tables keep their `model.max_len` rows.
    """
    if cfg.input_features:
        raise ExportError("feature inputs have no token embedding to export")
    import flax.linen as nn

    from flaxformer_lite.models import layer_layout

    # As `init` returns them or plain as restored; a scanned model's layers one by one.
    params = layer_layout.unstack(nn.meta.unbox(params))
    # The real vocabularies only: engines never see the padded rows (`nn/vocab.py`).
    v_source, v_target = cfg.vocab_size, cfg.output_vocab_size
    if "shared_embedding" in params:
        source = target = real_rows(_np(params["shared_embedding"]["embedding"]), v_source)
    else:
        source = real_rows(_np(params["source_embedding"]["embedding"]), v_source)
        target = real_rows(_np(params["target_embedding"]["embedding"]), v_target)
    dec = params["decoder"]
    if cfg.tie_output_embedding:
        output = Linear(target, None)
    else:
        kernel = real_rows(_np(dec["logits"]["kernel"]), v_target, axis=1)
        bias = real_rows(_np(dec["logits"]["bias"]), v_target)
        output = _linear(kernel, bias)  # [D, V] -> [V, D]
    return ModelLayout(
        config=cfg,
        encoder=_stack(
            params["encoder"], cfg, source, cfg.num_encoder_layers, position_rows, False
        ),
        decoder=_stack(dec, cfg, target, cfg.num_decoder_layers, position_rows, True),
        output=output,
    )
