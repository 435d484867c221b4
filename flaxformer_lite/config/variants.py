"""The optional run-config sections that switch on a model variant, and their checks.

`scheduled_sampling` feeds the autoregressive decoder its own predictions
(objectives/scheduled_sampling.py), `nat` trains the non-autoregressive model,
`copy` the pointer-generator head (models/pointer_generator.py) and
`guided_attention` pulls cross-attention towards the diagonal
(objectives/guided_attention.py). Each section is declared once, here: a frozen
dataclass of checked fields (fields.py) that the model and its objectives take as
it is. `check_nat`, `check_copy` and `check_guided_attention` then check a section
against the model, data and train sections that `run.parse` has already built.
"""

from __future__ import annotations

import dataclasses
import fractions
from collections.abc import Mapping

import ml_collections

from flaxformer_lite.config.errors import ConfigError
from flaxformer_lite.config.fields import (
    NON_NEGATIVE,
    POSITIVE,
    boolean,
    check_fields,
    field,
    head_indices,
    int_at_least,
    is_int,
    number,
    one_of,
    section,
)
from flaxformer_lite.config.model import TransformerConfig

# scheduled_sampling: what is fed, eps_i's schedule, which passes the gradient reaches.
SAMPLING_MODES = ("off", "argmax", "sample", "soft")
SAMPLING_SCHEDULES = ("linear", "exponential", "inverse_sigmoid", "constant")
SAMPLING_GRADIENTS = ("last", "all")
NAT_LENGTH_MODES = ("predict", "fixed")
NAT_OBJECTIVES = ("cmlm", "ctc")


@dataclasses.dataclass(frozen=True)
class ScheduledSampling:
    """`scheduled_sampling` (optional section): the decoder is fed its own predictions with
    probability 1 - eps_i (objectives/scheduled_sampling.py); mode "off" feeds the gold."""

    # what is fed: off (the gold: teacher forcing) | argmax | sample | soft (the
    # softmax-weighted embedding)
    mode: str = field("off", one_of(*SAMPLING_MODES))
    # the gold's probability eps_i: linear max(eps_min, k - c*i) | exponential k**i |
    # inverse_sigmoid k / (k + exp(i / k)) | constant k
    schedule: str = field("linear", one_of(*SAMPLING_SCHEDULES))
    k: float = field(1.0, number(0.0))  # of the schedule; linear with k = 0: always fed
    c: float = field(1e-4, number(0.0))  # linear: the decrease of eps_i per step
    eps_min: float = field(0.0, number(0.0, 1.0, high_open=False))  # the floor of eps_i
    warmup_steps: int = field(0, NON_NEGATIVE)  # steps of pure teacher forcing; i counts after
    temperature: float = field(1.0, number(0.0, low_open=True))  # sample/soft: of the softmax
    # last: the gradient through the last pass only | all (soft only)
    gradient: str = field("last", one_of(*SAMPLING_GRADIENTS))
    # decoder passes per step (the last is scored): 2 = two-pass decoder, more = the
    # parallel variant
    passes: int = field(2, int_at_least(2))

    def __post_init__(self):
        check_fields(self, "scheduled_sampling")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass(frozen=True)
class NATConfig:
    """`nat` (optional section): a run config with it trains a non-autoregressive model:
    objective "cmlm" the length classifier and masked decoder of models/non_autoregressive.py
    (Mask-Predict; `iterations` and `length_beam` are evaluation's), "ctc" the upsampled
    decoder of models/ctc_nat.py (`upsample_ratio`, `glance_*`; no length field applies)."""

    # cmlm: masked tokens, a length classifier, Mask-Predict | ctc: an upsampled source copy,
    # the CTC loss with glancing, argmax-and-collapse decoding (needs decoder_inputs='copy')
    objective: str = field("cmlm", one_of(*NAT_OBJECTIVES))
    length_mode: str = field("predict", one_of(*NAT_LENGTH_MODES))  # fixed: cut at first EOS
    length_classes: int = field(256, int_at_least(2))  # target - source offsets, centred
    length_loss_weight: float = field(0.1, number(0.0))  # beside the token loss (fairseq 0.1)
    length_stop_gradient: bool = field(False, boolean)  # True: it does not train the encoder
    decoder_inputs: str = field("mask", one_of("mask", "copy"))  # copy: uniform source copy
    masking: str = field("uniform", one_of("uniform", "all"))  # all: single-pass NAT
    iterations: int = field(10, POSITIVE)  # evaluation: Mask-Predict decoder calls
    length_beam: int = field(1, POSITIVE)  # evaluation: length candidates per source
    # ctc: decoder positions = ceil(upsample_ratio * source tokens, EOS included)
    upsample_ratio: float = field(3.0, number(1.0))
    # ctc: the glancing ratio at step 0: revealed inputs = floor(ratio * wrong positions)
    glance_start: float = field(0.5, number(0.0, 1.0, high_open=False))
    # ctc: the ratio from glance_steps on (linear in between); 0 and 0: no glancing pass
    glance_end: float = field(0.3, number(0.0, 1.0, high_open=False))
    glance_steps: int = field(300_000, POSITIVE)  # ctc: steps of the linear anneal

    def __post_init__(self):
        check_fields(self, "nat")


def upsampled_length(source_len, ratio: float):
    """The ctc objective's decoder positions for `source_len` source tokens: ceil(ratio * S),
    in integer arithmetic so that a Python int (a batch's width) and an int array (each
    row's length) agree exactly, also for ratios such as 1.1."""
    fraction = fractions.Fraction(ratio).limit_denominator(1000)
    return -(-source_len * fraction.numerator // fraction.denominator)


@dataclasses.dataclass(frozen=True)
class CopyHead:
    """`copy` (optional section): a run config with it trains the pointer-generator head
    (models/pointer_generator.py) on extended ids (data/extended_ids.py), copying with
    the mean of these heads of this decoder layer's cross-attention."""

    # the decoder layer whose cross-attention is the copy distribution (negative: from the last)
    layer: int = field(-1, lambda flag, v: None if is_int(v) else f"{flag} must be an integer")
    heads: tuple[int, ...] = field((), head_indices)  # its heads averaged; (): all

    def __post_init__(self):
        check_fields(self, "copy")

    def attention_name(self, config: TransformerConfig) -> str:
        """The capture name of the copied layer, e.g. "decoder/cross/2"."""
        return f"decoder/cross/{self.layer % config.num_decoder_layers}"


def _layer_indices(flag, v):
    if isinstance(v, (tuple, list)) and v and all(is_int(i) for i in v):
        return None
    return f"{flag} must be a non-empty tuple of decoder layer indices, got {v!r}"


@dataclasses.dataclass(frozen=True)
class GuidedAttention:
    """`guided_attention` (optional section): pulls the chosen decoder layers' cross-attention
    towards the diagonal (objectives/guided_attention.py); weight 0 leaves it off."""

    weight: float = field(0.0, number(0.0))  # of the penalty beside cross-entropy; 0: off
    # width g of the diagonal guide; ESPnet's default (the paper uses 0.2)
    sigma: float = field(0.4, number(0.0, low_open=True))
    layers: tuple[int, ...] = field((-2, -1), _layer_indices)  # guided decoder layers
    heads: tuple[int, ...] = field((0, 1), head_indices)  # guided heads of them; (): all

    def __post_init__(self):
        check_fields(self, "guided_attention")

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    def capture_names(self, num_decoder_layers: int) -> tuple[str, ...]:
        """The guided layers as capture names ("decoder/cross/I"), each once."""
        layers = dict.fromkeys(i % num_decoder_layers for i in self.layers)
        return tuple(f"decoder/cross/{i}" for i in layers)


def guided_attention_of(config: ml_collections.ConfigDict | Mapping) -> GuidedAttention:
    """The `guided_attention` section of a run config (off when it has none)."""
    return section(GuidedAttention, "guided_attention", config.get("guided_attention", None) or {})


def check_guided_attention(guided, model, sampling, nat, copy) -> None:
    if not guided.enabled:
        return
    layers, heads = model.num_decoder_layers, model.num_heads
    if any(not -layers <= i < layers for i in guided.layers):
        raise ConfigError(
            f"guided_attention.layers={guided.layers} names a decoder layer the model lacks: it "
            f"has {layers} (use 0..{layers - 1}, or negative from the last)"
        )
    if any(h >= heads for h in guided.heads):
        raise ConfigError(
            f"guided_attention.heads={guided.heads} names a head the model lacks: it has "
            f"{heads} (use indices 0..{heads - 1}, or () for all)"
        )
    if nat is not None:
        raise ConfigError(
            "guided_attention guides the autoregressive decoder, but this run config has a nat "
            "section: set guided_attention.weight=0 or drop the nat section"
        )
    if copy is not None:
        raise ConfigError(
            "guided_attention is not supported with the copy head: set "
            "guided_attention.weight=0 or drop the copy section"
        )
    if sampling.mode != "off":
        raise ConfigError(
            f"guided_attention is not supported with scheduled_sampling.mode={sampling.mode!r}: "
            "set guided_attention.weight=0 or scheduled_sampling.mode='off'"
        )


def _optional_section(config: ml_collections.ConfigDict | Mapping, name: str, cls):
    """Section `name` of a run config built as `cls`; None when the config has none."""
    values = config.get(name, None)
    return None if values is None else section(cls, name, values)


def copy_of(config: ml_collections.ConfigDict | Mapping) -> CopyHead | None:
    """The `copy` section of a run config (or of a workdir's saved one); None: no copy head."""
    return _optional_section(config, "copy", CopyHead)


def check_copy(copy, model, data, sampling, nat) -> None:
    layers, heads = model.num_decoder_layers, model.num_heads
    if not -layers <= copy.layer < layers:
        raise ConfigError(
            f"copy.layer={copy.layer} names no decoder layer: the model has {layers} "
            f"(use 0..{layers - 1}, or -1 for the last)"
        )
    if any(h >= heads for h in copy.heads):
        raise ConfigError(
            f"copy.heads={tuple(copy.heads)} names a head the model lacks: it has {heads} "
            f"(use indices 0..{heads - 1}, or () for all)"
        )
    if nat is not None:
        raise ConfigError(
            "the copy head extends the autoregressive decoder, but this run config also has a "
            "nat section: drop one of them"
        )
    if model.input_features:
        raise ConfigError(
            "the copy head copies source tokens, but model.input_features reads features: "
            "drop the copy section or use token inputs"
        )
    if not data.shared_vocab:
        raise ConfigError(
            "the copy head emits a source token by its id, which needs one vocabulary for both "
            "sides: set --config.data.shared_vocab=True and --config.model.share_embeddings=True"
        )
    if data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but extended ids are numbered "
            "per example: use --config.data.batching=bucket or fixed with the copy head"
        )
    if sampling.mode != "off":
        raise ConfigError(
            f"scheduled_sampling.mode={sampling.mode!r} is not supported with the copy head "
            "(its fed predictions would need extended ids): drop one of them"
        )


def nat_of(config: ml_collections.ConfigDict | Mapping) -> NATConfig | None:
    """The `nat` section of a run config (None: it trains the autoregressive model)."""
    return _optional_section(config, "nat", NATConfig)


def check_nat(nat, model, data, train, sampling) -> None:
    if sampling.mode != "off":
        raise ConfigError(
            f"scheduled_sampling.mode={sampling.mode!r} feeds an autoregressive decoder its "
            "own predictions, but this run config has a nat section: drop one of them"
        )
    if data.batching == "pack":
        raise ConfigError(
            "data.batching='pack' puts several examples in a row, but the non-autoregressive "
            "decoder reads one per row: use --config.data.batching=bucket or fixed"
        )
    if train.exposure_report:
        raise ConfigError(
            "train.exposure_report compares teacher forcing with autoregressive decoding, "
            "which a nat run has not: set --config.train.exposure_report=False"
        )
    if nat.decoder_inputs == "copy" and model.input_features:
        raise ConfigError(
            "nat.decoder_inputs='copy' copies source token embeddings, but the encoder reads "
            "features: use nat.decoder_inputs='mask'"
        )
    if nat.objective == "ctc":
        _check_ctc(nat, model, data, train)
    if nat.length_mode == "fixed" and nat.length_beam > 1:
        raise ConfigError(
            f"nat.length_beam={nat.length_beam} decodes several predicted lengths, but "
            "nat.length_mode='fixed' has one: set length_beam=1 or length_mode='predict'"
        )


def _check_ctc(nat, model, data, train) -> None:
    ctc = "nat.objective='ctc'"
    if nat.decoder_inputs != "copy":
        raise ConfigError(
            f"{ctc} feeds the decoder an upsampled copy of the source: set "
            "nat.decoder_inputs='copy'"
        )
    for name, cmlm in (("length_mode", "predict"), ("masking", "uniform"), ("length_beam", 1)):
        if getattr(nat, name) != cmlm:
            raise ConfigError(
                f"nat.{name}={getattr(nat, name)!r} is the cmlm objective's, but {ctc} takes "
                f"its output length from the CTC collapse: drop nat.{name}"
            )
    if train.label_smoothing:
        raise ConfigError(
            f"train.label_smoothing={train.label_smoothing} smooths cross-entropy labels, but "
            f"{ctc} trains with the CTC loss: set --config.train.label_smoothing=0"
        )
    if train.best_metric == "token_accuracy":
        raise ConfigError(
            f"train.best_metric='token_accuracy' needs a prediction per target token, which "
            f"{ctc} has not: use loss, bleu or exact_match"
        )
    width = upsampled_length(data.max_source_len, nat.upsample_ratio)
    if model.positions == "learned" and width > model.max_len:
        raise ConfigError(
            f"nat.upsample_ratio={nat.upsample_ratio} gives up to {width} decoder positions, "
            f"more than model.max_len={model.max_len} learned positions: raise model.max_len"
        )


def scheduled_sampling_section(config: ml_collections.ConfigDict | Mapping) -> ScheduledSampling:
    """The `scheduled_sampling` section of a run config (off when it has none), its
    fields checked together."""
    values = config.get("scheduled_sampling", None) or {}
    s = section(ScheduledSampling, "scheduled_sampling", values)
    if s.schedule == "exponential" and not s.k < 1.0:
        raise ConfigError(
            f"scheduled_sampling.k={s.k} with the exponential schedule k**i never decays: "
            "use 0 < k < 1, e.g. 0.999"
        )
    if s.schedule == "inverse_sigmoid" and s.k < 1.0:
        raise ConfigError(
            f"scheduled_sampling.k={s.k}: the inverse sigmoid k / (k + exp(i / k)) needs "
            "k >= 1 (the step where eps is 0.5 grows with k), e.g. 500"
        )
    if s.gradient == "all" and s.mode in ("argmax", "sample"):
        raise ConfigError(
            f"scheduled_sampling.gradient='all' passes gradients through the fed predictions, "
            f"but mode={s.mode!r} feeds discrete tokens, which have none: use mode='soft' or "
            "gradient='last'"
        )
    return s
