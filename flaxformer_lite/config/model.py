"""Model configuration: one frozen dataclass, modes derived with `.replace(...)`.

Sizes follow the notation of Vaswani et al. (2017): `d_model`, `d_ff`, `h`
(`num_heads`) and `d_k = d_v` (`d_kv`). Every check that can fail with a
user-supplied value raises `ConfigError` with a message naming the field and
the fix, so the command-line tools can print one line instead of a traceback.

Logical axis names (used by `partitioning.py` to map parameters and
activations onto a device mesh):

  batch   examples in a batch
  length  sequence positions
  embed   the model dimension d_model
  heads   attention heads h
  kv      per-head key/value dimension d_k = d_v
  mlp     the feed-forward hidden dimension d_ff
  vocab   the vocabulary
  qkv     the stacked query/key/value projection index (never sharded)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from flaxformer_lite.config.errors import ConfigError

POSITIONS = ("sinusoidal", "learned", "none")
NORMS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu")
ATTENTION_IMPLS = ("auto", "vmap", "fast", "cudnn", "splash")  # see nn/kernels.py
DROPOUT_RNGS = ("hash", "threefry")
# What a layer keeps for the backward pass (models/blocks.remat_policy): "none" keeps every
# activation; the others recompute the layer's forward pass in the backward one, saving
# nothing ("full", "nothing_saveable"), every matmul output ("dots_saveable") or those
# without batch dimensions (the weight matmuls, "dots_with_no_batch_dims_saveable").
REMAT_POLICIES = (
    "none",
    "full",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder Transformer.

    The defaults are the paper's base model (Table 3, row "base").
    """

    vocab_size: int = 37000  # source vocabulary (the shared one when share_embeddings)
    target_vocab_size: int | None = None  # None: same vocabulary as the source
    # Embedding and softmax rows are padded to a multiple of this (1: none): 128 is the lane
    # width of TPU vector units and a multiple of every GPU MMA tile, and powers of two up
    # to 128 divide it (the `model` mesh axis). The padding is never an output (`vocab.py`).
    vocab_multiple: int = 128
    input_features: int = 0  # 0: the encoder reads token ids; > 0: float features of this size
    share_embeddings: bool = True  # one matrix for encoder input, decoder input, softmax (§3.4)
    tie_output_embedding: bool = True  # decoder input embedding reused as pre-softmax weights
    d_model: int = 512  # the width of every sub-layer's output and of the embeddings (§3)
    num_heads: int = 8  # attention heads h (§3.2.2)
    d_kv: int | None = None  # per-head d_k = d_v; None: d_model // num_heads (Table 3 A/B vary it)
    d_ff: int = 2048  # the feed-forward hidden size (§3.3)
    num_encoder_layers: int = 6  # N of the encoder stack (§3.1)
    num_decoder_layers: int = 6  # N of the decoder stack
    dropout_rate: float = 0.1  # P_drop: sub-layer outputs and embedding sums (§5.4)
    attention_dropout_rate: float = 0.0  # on attention weights; the paper uses none
    dropout_rng: str = "hash"  # mask bits: "hash" (fused, fast) | "threefry" (jax.random)
    max_len: int = 512  # longest sequence for learned positions (sinusoids have no limit)
    positions: str = "sinusoidal"  # "sinusoidal" | "learned" (Table 3 row E) | "none"
    norm: str = "post"  # "post": LayerNorm(x + Sublayer(x)) as in §3.1; "pre": x + Sublayer(LN(x))
    activation: str = "relu"  # feed-forward non-linearity: "relu" (§3.3) | "gelu"
    # "auto": cuDNN flash (GPU) / splash (TPU) / XLA; or vmap | fast | cudnn | splash to force
    # one (nn/kernels.py); one line per run says which runs, and why
    attention_impl: str = "auto"
    encoder_window: int = 0  # > 0: encoder query i attends keys |i - j| <= r, O(n r); 0 = full
    decoder_window: int = 0  # > 0: decoder query i attends i - r <= j <= i, O(n r); 0 = full
    layer_norm_epsilon: float = 1e-6  # added to the variance; 1e-6 as in tensor2tensor
    # matmul operands ("auto" in run configs: bfloat16 on GPU/TPU, float32 on CPU); softmax,
    # LayerNorm statistics, loss and every matmul's accumulation stay float32
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32  # storage of parameters (optim.state_dtype: of Adam's moments)
    scan_layers: bool = False  # one lax.scan over parameters stored stacked [L, ...] per leaf
    remat: str = "none"  # per layer: what the backward pass recomputes (REMAT_POLICIES)
    # Convolutional front end for features (nn/subsampling.py): each layer halves the frames.
    subsampling_layers: int = 0  # 0: none; n: n stride-2 Conv1d + GLU layers (2**n fewer frames)
    subsampling_kernel: int = 5  # odd kernel width of every conv layer
    subsampling_channels: int = 256  # channels after each conv's GLU

    def __post_init__(self):
        if isinstance(self.remat, bool):  # run configs saved when remat was a switch
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        # In this order, so that a config with several mistakes names the same one first.
        self._check_sizes()
        self._check_subsampling()
        self._check_heads_and_vocabularies()
        self._check_choices()

    def _check_sizes(self):
        for name in (
            "vocab_size",
            "vocab_multiple",
            "d_model",
            "num_heads",
            "d_ff",
            "num_encoder_layers",
            "num_decoder_layers",
            "max_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.input_features, int) or self.input_features < 0:
            raise ConfigError(
                f"model.input_features must be 0 (token ids) or a feature size, "
                f"got {self.input_features!r}"
            )
        for name in ("encoder_window", "decoder_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"model.{name} must be 0 (full attention) or a window r >= 1, got {value!r}"
                )

    def _check_heads_and_vocabularies(self):
        if self.target_vocab_size is not None and self.target_vocab_size < 1:
            raise ConfigError(
                f"model.target_vocab_size must be a positive integer or None, "
                f"got {self.target_vocab_size!r}"
            )
        if self.d_kv is None and self.d_model % self.num_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; choose num_heads dividing d_model or set model.d_kv"
            )
        if self.d_kv is not None and (not isinstance(self.d_kv, int) or self.d_kv < 1):
            raise ConfigError(f"model.d_kv must be a positive integer or None, got {self.d_kv!r}")
        if self.share_embeddings and self.target_vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                f"model.share_embeddings needs one vocabulary, but vocab_size={self.vocab_size} "
                f"and target_vocab_size={self.target_vocab_size}; set "
                "model.share_embeddings=False or make the sizes equal"
            )

    def _check_choices(self):
        for name, allowed in (
            ("positions", POSITIONS),
            ("norm", NORMS),
            ("activation", ACTIVATIONS),
            ("attention_impl", ATTENTION_IMPLS),
            ("dropout_rng", DROPOUT_RNGS),
            ("remat", REMAT_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"model.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        for name in ("dropout_rate", "attention_dropout_rate"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {value!r}")

    def _check_subsampling(self):
        n, k, c = self.subsampling_layers, self.subsampling_kernel, self.subsampling_channels
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"model.subsampling_layers must be an integer >= 0, got {n!r}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k % 2 == 0:
            raise ConfigError(f"model.subsampling_kernel must be odd and positive, got {k!r}")
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ConfigError(f"model.subsampling_channels must be a positive integer, got {c!r}")
        if n and not self.input_features:
            raise ConfigError(
                f"model.subsampling_layers={n} subsamples feature frames, but the encoder reads "
                "token ids: set model.input_features or subsampling_layers=0"
            )

    @property
    def subsampling(self) -> int:
        """The encoder's frame reduction factor: 2 ** subsampling_layers."""
        return 2**self.subsampling_layers

    @property
    def head_dim(self) -> int:
        """d_k = d_v, the per-head key/value size."""
        return self.d_kv if self.d_kv is not None else self.d_model // self.num_heads

    @property
    def output_vocab_size(self) -> int:
        """Size of the decoder's softmax (its real entries; see `padded`)."""
        return self.target_vocab_size or self.vocab_size

    def padded(self, size: int) -> int:
        """The rows stored for a vocabulary of `size`: `size` rounded up to `vocab_multiple`."""
        return -(-size // self.vocab_multiple) * self.vocab_multiple

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view (dtypes as names), used to tag checkpoints."""
        out = dataclasses.asdict(self)
        out["dtype"] = jnp.dtype(self.dtype).name
        out["param_dtype"] = jnp.dtype(self.param_dtype).name
        return out


def from_mapping(values: dict[str, Any]) -> TransformerConfig:
    """Builds a config from a (ml_collections or plain) mapping, rejecting unknown keys."""
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown model config key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    values = dict(values)
    for name in ("dtype", "param_dtype"):
        if name in values and isinstance(values[name], str):
            values[name] = parse_dtype(name, values[name])
    return TransformerConfig(**values)


FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def parse_dtype(name: str, value: str, platform: str | None = None):
    """A dtype name as a jnp dtype; "auto" (compute dtype only) is the platform's: bfloat16
    on GPUs and TPUs, whose matmul units run it at full rate with float32 accumulation,
    float32 on CPUs, which have no fast bf16 path for it (`precision.py`)."""
    if value == "auto" and name == "dtype":
        from flaxformer_lite.nn import kernels

        platform = platform or kernels.target_platform()
        # An unknown platform (a config checked before JAX starts) gets a placeholder.
        return jnp.dtype(jnp.float32 if platform in ("cpu", None) else jnp.bfloat16)
    if value not in FLOAT_DTYPES:
        choices = ", ".join(("auto",) * (name == "dtype") + FLOAT_DTYPES)
        raise ConfigError(f"model.{name}={value!r} is not a dtype name; use one of {choices}")
    return jnp.dtype(value)
