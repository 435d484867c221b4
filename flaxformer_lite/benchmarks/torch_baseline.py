"""A PyTorch `nn.Transformer` built to our config: the baseline of `bench.py --compare torch`.

PyTorch is an optional dependency (`pip install -e ".[torch]"`); this is the
only library module that imports it, and nothing else in the package imports this
module except `benchmark.compare_train_benchmark`, lazily.

`torch.nn.Transformer` is the encoder-decoder stack only. `Seq2Seq` adds what
it lacks to be our model: a shared token embedding scaled by sqrt(d_model)
(§3.4), sinusoidal (or learned) positions (§3.5), dropout on the embedding
sums (§5.4), the output projection tied to the embedding, key-padding and
causal masks, and the same label-smoothed cross entropy. What remains
different from `model.Transformer`:

  * `nn.Transformer` always ends each stack with a LayerNorm. With pre-LN we
    have the same (our `final_norm`); with post-LN it is an extra LayerNorm
    after the last layer's own, 2 * 2 * d_model parameters more than ours.
  * torch computes the weights of a source row that is entirely PAD as NaN
    (every key masked); ours gives them uniform weights. Benchmark batches
    have no padding rows.

Two of torch's dropouts are set to ours: the one on attention weights (torch
uses P_drop; ours `attention_dropout_rate`, 0 in the paper) and the one on
the feed-forward hidden layer (torch has it, we and the paper do not). The
attention projections are initialised like ours (Glorot per [D, D]
projection, not over the stacked [3D, D]), so losses start alike too.

Letter legend as in `attention.py` (B batch, S source length, T target length,
D d_model, N heads, H head dim, F d_ff, V vocabulary).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from typing import Any

import numpy as np

from flaxformer_lite.config import ConfigError, TransformerConfig
from flaxformer_lite.constants import PAD_ID
from flaxformer_lite.nn.vocab import PADDED_LOGIT

try:
    import torch
    from torch import nn
except ImportError as e:  # optional dependency: say how to get it
    raise ImportError(
        'flaxformer_lite.benchmarks.torch_baseline needs PyTorch; pip install -e ".[torch]"'
    ) from e


def check_config(config: TransformerConfig) -> None:
    """Raises ConfigError for the configs `nn.Transformer` cannot express."""
    if config.head_dim * config.num_heads != config.d_model:
        raise ConfigError(
            f"the torch baseline needs num_heads * head_dim == d_model (nn.MultiheadAttention); "
            f"got model.d_kv={config.d_kv}"
        )
    if not (config.share_embeddings and config.tie_output_embedding):
        raise ConfigError(
            "the torch baseline has one shared, tied embedding; set model.share_embeddings and "
            "model.tie_output_embedding"
        )


def sinusoids(length: int, d_model: int) -> torch.Tensor:
    """`layers.sinusoidal_positions` of 0..length-1, computed the same way: float32[length, D]."""
    i = np.arange(d_model) // 2
    inv_freq = torch.from_numpy(np.power(10000.0, -2.0 * i / d_model).astype(np.float32))  # [D]
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq  # [length, D]
    even = torch.from_numpy(np.arange(d_model) % 2 == 0)
    return torch.where(even, torch.sin(angles), torch.cos(angles))


class Seq2Seq(nn.Module):
    """`nn.Transformer` (batch first) with shared scaled embeddings, positions, tied logits."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        check_config(config)
        d = config.d_model
        self.config = config
        # Our padded rows (`nn/vocab.py`), so that the output matmul has our shape.
        self.embedding = nn.Embedding(config.padded(config.vocab_size), d)
        nn.init.normal_(self.embedding.weight, std=d**-0.5)  # as `layers.Embed`
        with warnings.catch_warnings():  # the nested-tensor fast path is for inference only
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=d,
                nhead=config.num_heads,
                num_encoder_layers=config.num_encoder_layers,
                num_decoder_layers=config.num_decoder_layers,
                dim_feedforward=config.d_ff,
                dropout=config.dropout_rate,
                # flax's nn.gelu is the tanh approximation; torch's "gelu" is exact.
                activation=(
                    "relu"
                    if config.activation == "relu"
                    else functools.partial(nn.functional.gelu, approximate="tanh")
                ),
                layer_norm_eps=config.layer_norm_epsilon,
                batch_first=True,
                norm_first=config.norm == "pre",
            )
        layers = [*self.transformer.encoder.layers, *self.transformer.decoder.layers]
        for layer in layers:
            layer.dropout = nn.Identity()  # no dropout inside the FFN (§3.3)
            for attn in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                if attn is not None:
                    attn.dropout = config.attention_dropout_rate
                    for w in attn.in_proj_weight.data.chunk(3):  # W_Q, W_K, W_V
                        nn.init.xavier_uniform_(w)
        if config.positions == "learned":
            self.source_positions = nn.Parameter(torch.randn(config.max_len, d) * 0.02)
            self.target_positions = nn.Parameter(torch.randn(config.max_len, d) * 0.02)
        self.register_buffer("sinusoids", sinusoids(config.max_len, d), persistent=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def _embed(self, tokens: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        """int[B, L] -> [B, L, D]: scaled embedding + positions, then dropout."""
        length = tokens.shape[1]
        x = self.embedding(tokens) * math.sqrt(self.config.d_model)
        if self.config.positions == "learned":
            x = x + table[:length]
        elif self.config.positions == "sinusoidal":
            pe = self.sinusoids
            if length > pe.shape[0]:
                pe = sinusoids(length, self.config.d_model).to(x.device)
            x = x + pe[:length]
        return self.dropout(x)

    def forward(self, inputs: torch.Tensor, decoder_inputs: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass: int[B, S], int[B, T] (PAD_ID = padding) -> float[B, T, V]."""
        learned = self.config.positions == "learned"
        x = self._embed(inputs, self.source_positions if learned else None)  # [B, S, D]
        y = self._embed(decoder_inputs, self.target_positions if learned else None)  # [B, T, D]
        t = decoder_inputs.shape[1]
        # torch masks are True where attention is NOT allowed (ours: where it is).
        causal = torch.ones(t, t, dtype=torch.bool, device=y.device).triu(1)  # [T, T]
        source_pad = inputs == PAD_ID  # [B, S]
        h = self.transformer(
            x,
            y,
            tgt_mask=causal,
            src_key_padding_mask=source_pad,
            tgt_key_padding_mask=decoder_inputs == PAD_ID,
            memory_key_padding_mask=source_pad,
            tgt_is_causal=True,
        )  # [B, T, D]
        logits = h @ self.embedding.weight.T  # tied pre-softmax projection: [B, T, Vp]
        if logits.shape[-1] == self.config.vocab_size:
            return logits
        padded = torch.arange(logits.shape[-1], device=logits.device) >= self.config.vocab_size
        return logits.masked_fill(padded, PADDED_LOGIT)  # as `vocab.mask_logits`


def shift_right(targets: torch.Tensor, bos_id: int) -> torch.Tensor:
    """`model.shift_right` without packing: BOS + targets[:, :-1]. int[B, T] -> int[B, T]."""
    bos = torch.full_like(targets[:, :1], bos_id)
    return torch.cat([bos, targets[:, :-1]], dim=1)


def loss_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross entropy and token count, as `losses.cross_entropy`.

    The smoothed target is 1 - eps on the gold token and eps / (V - 1) on the
    others (ours; `F.cross_entropy(label_smoothing=eps)` would put eps / V on
    every token, the gold one included). PAD_ID labels weigh 0.

    Args:
      logits: float[B, T, Vp], the columns from `vocab_size` on PADDED_LOGIT (probability 0).
      labels: int[B, T].
      vocab_size: the real vocabulary V (None: Vp).
    Returns:
      (float32 scalar sum of -sum_v q_v log p_v over real tokens, float32 token count).
    """
    logits = logits[..., :vocab_size]  # the padding has no probability, no smoothing mass
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    weights = (labels != PAD_ID).float()  # [B, T]
    gold = log_probs.gather(-1, labels[..., None])[..., 0]  # [B, T]
    if label_smoothing > 0.0:
        low = label_smoothing / (logits.shape[-1] - 1)
        smoothed = -((1.0 - label_smoothing - low) * gold + low * log_probs.sum(-1))
    else:
        smoothed = -gold
    return (smoothed * weights).sum(), weights.sum()


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def load_flax_params(model: Seq2Seq, params: dict[str, Any]) -> None:
    """Copies our parameters (`model.Transformer`, unboxed) into `model`, in place.

    Torch's extra post-LN final LayerNorms (see the module docstring) are left
    as they are. Used to check that both compute the same function.
    """
    with torch.no_grad():
        model.embedding.weight.copy_(_tensor(params["shared_embedding"]["embedding"]))
        for side, stack in (
            ("encoder", model.transformer.encoder),
            ("decoder", model.transformer.decoder),
        ):
            _copy_stack(model, side, stack, params[side])


def _tensor(a) -> torch.Tensor:
    """A float32 torch copy of a numpy or JAX array."""
    return torch.from_numpy(np.asarray(a, np.float32).copy())


def _copy_stack(model: Seq2Seq, side: str, stack, ours: dict[str, Any]) -> None:
    """Our encoder or decoder (`side`) into torch's layer `stack` and its position table."""
    from flaxformer_lite.models import layer_layout

    d = model.config.d_model
    for i, layer in enumerate(stack.layers):
        p = layer_layout.layer(ours, i)  # either layout
        _copy_attention(layer.self_attn, p["self_attention"], d)
        _copy_norm(layer.norm1, p["self_attention_residual"]["norm"])
        _copy_ffn(layer, p["ffn"])
        if side == "encoder":
            _copy_norm(layer.norm2, p["ffn_residual"]["norm"])
        else:
            _copy_attention(layer.multihead_attn, p["cross_attention"], d)
            _copy_norm(layer.norm2, p["cross_attention_residual"]["norm"])
            _copy_norm(layer.norm3, p["ffn_residual"]["norm"])
    if "final_norm" in ours:
        _copy_norm(stack.norm, ours["final_norm"])
    if model.config.positions == "learned":
        table = model.source_positions if side == "encoder" else model.target_positions
        table.copy_(_tensor(ours["positions"]["pos_embedding"]))


def _copy_attention(mha, p: dict[str, Any], d: int) -> None:
    """Our fused (self) or split q / kv (cross) projections into torch's `in_proj`."""
    if "qkv_kernel" in p:
        kernel = np.asarray(p["qkv_kernel"]).reshape(d, 3 * d)  # [D, 3*N*H]
        bias = np.asarray(p["qkv_bias"]).reshape(3 * d)
    else:
        kernel = np.concatenate(
            [
                np.asarray(p["q_kernel"]).reshape(d, d),
                np.asarray(p["kv_kernel"]).reshape(d, 2 * d),
            ],
            axis=1,
        )
        bias = np.concatenate(
            [np.asarray(p["q_bias"]).reshape(d), np.asarray(p["kv_bias"]).reshape(2 * d)]
        )
    mha.in_proj_weight.copy_(_tensor(kernel.T))  # [3D, D], rows q | k | v, head-major
    mha.in_proj_bias.copy_(_tensor(bias))
    mha.out_proj.weight.copy_(_tensor(np.asarray(p["out_kernel"]).reshape(d, d).T))
    mha.out_proj.bias.copy_(_tensor(p["out_bias"]))


def _copy_norm(ln, p: dict[str, Any]) -> None:
    ln.weight.copy_(_tensor(p["scale"]))
    ln.bias.copy_(_tensor(p["bias"]))


def _copy_ffn(layer, p: dict[str, Any]) -> None:
    layer.linear1.weight.copy_(_tensor(np.asarray(p["wi"]["kernel"]).T))
    layer.linear1.bias.copy_(_tensor(p["wi"]["bias"]))
    layer.linear2.weight.copy_(_tensor(np.asarray(p["wo"]["kernel"]).T))
    layer.linear2.bias.copy_(_tensor(p["wo"]["bias"]))


class TrainStep:
    """One eager (or `torch.compile`d) training step of `Seq2Seq`, Adam(0.9, 0.98, 1e-9).

    The gradient is that of the per-token mean loss, as in `train_lib.train_step`.
    Adam is torch's fused implementation where available (on the CPU since
    torch 2.4: it beat the default per-tensor loop); `torch.compile` covers the
    forward and backward passes, not the optimiser.
    With a compute dtype other than float32 the forward pass runs under
    `torch.autocast` (parameters stay float32, as ours).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        label_smoothing: float = 0.1,
        bos_id: int = 2,
        learning_rate: float = 1e-4,
        seed: int = 0,
        device: str = "cpu",
        compile: bool = False,
    ):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = Seq2Seq(config).to(self.device).train()
        adam = dict(lr=learning_rate, betas=(0.9, 0.98), eps=1e-9)
        try:  # one kernel over all parameters, as XLA fuses our update
            self.optimizer = torch.optim.Adam(self.model.parameters(), fused=True, **adam)
            self.fused_adam = True
        except RuntimeError:  # torch < 2.4 has no fused Adam on the CPU
            self.optimizer = torch.optim.Adam(self.model.parameters(), **adam)
            self.fused_adam = False
        self.label_smoothing, self.bos_id = label_smoothing, bos_id
        dtype = np.dtype(config.dtype)
        self.autocast_dtype = None if dtype == np.float32 else getattr(torch, dtype.name)
        self.loss = self._loss
        if compile:
            self.loss = torch.compile(self._loss)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        context = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with context:
            logits = self.model(inputs, shift_right(targets, self.bos_id))  # [B, T, V]
        total, tokens = loss_sums(
            logits, targets, self.label_smoothing, self.model.config.vocab_size
        )
        return total / tokens.clamp(min=1.0)

    def to_device(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """{"inputs" int[B, S], "targets" int[B, T]} numpy -> int64 tensors on the device."""
        return {k: torch.from_numpy(np.asarray(v)).long().to(self.device) for k, v in batch.items()}

    def __call__(self, batch: dict[str, torch.Tensor]) -> float:
        """Updates the parameters on one batch; returns the mean smoothed loss before it.

        `.item()` waits for the device, as `block_until_ready` does for ours.
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(batch["inputs"], batch["targets"])
        loss.backward()
        self.optimizer.step()
        return loss.item()


def setup(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Process-wide torch settings for a fair comparison; returns them for the record.

    CPU: intra-op threads on every core (XLA's CPU backend also uses them all).
    CUDA: float32 matmuls may use TF32, as XLA's default precision does on GPUs.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "JAX runs on a GPU but this PyTorch build has no CUDA; install a CUDA build of "
            "torch, or compare on the CPU with JAX_PLATFORMS=cpu"
        )
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.set_float32_matmul_precision("high")
    return {"torch_version": torch.__version__, "torch_threads": threads, "torch_device": device}
