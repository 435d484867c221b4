"""The model kind and the evaluation search a run config describes.

A run config without a `nat` section trains the autoregressive model
(`models/autoregressive.py`); with one, the non-autoregressive model
(`models/non_autoregressive.py`); with a `copy` section, the autoregressive
model with the pointer-generator head. Training, `decode.py` and `--dry_run` build
the model here, so a workdir decodes with the kind it was trained as.
"""

from __future__ import annotations

import ml_collections

from flaxformer_lite import run_config as run_config_lib
from flaxformer_lite.config import TransformerConfig
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.models.non_autoregressive import NATSearch, NonAutoregressiveModel
from flaxformer_lite.models.pointer_generator import CopyHead


def build_model(config: ml_collections.ConfigDict, model_cfg: TransformerConfig) -> Seq2SeqModel:
    """The run's model behind the protocol."""
    nat = run_config_lib.nat_of(config)
    if nat is None:
        copy = run_config_lib.copy_of(config)
        return AutoregressiveModel(
            model_cfg,
            label_smoothing=config.train.label_smoothing,
            scheduled_sampling=run_config_lib.scheduled_sampling_of(config),
            copy=None if copy is None else CopyHead(copy.layer, tuple(copy.heads)),
            guided_attention=run_config_lib.guided_attention_of(config),
        )
    return NonAutoregressiveModel(
        model_cfg,
        label_smoothing=config.train.label_smoothing,
        length_mode=nat.length_mode,
        length_classes=nat.length_classes,
        length_loss_weight=nat.length_loss_weight,
        length_stop_gradient=nat.length_stop_gradient,
        decoder_inputs=nat.decoder_inputs,
        masking=nat.masking,
    )


def has_copy_head(run_config: dict | ml_collections.ConfigDict) -> bool:
    """Whether a run config (or a workdir's saved one) trains the copy head: its data then
    carry extended ids (`data/extended_ids.py`)."""
    return run_config.get("copy") is not None


def is_non_autoregressive(run_config: dict | ml_collections.ConfigDict) -> bool:
    """Whether a run config (or a workdir's saved one) trains the non-autoregressive model."""
    return run_config.get("nat") is not None


def search_from_config(config: ml_collections.ConfigDict) -> predict.SearchConfig | NATSearch:
    """The search evaluation decodes with."""
    t, max_len = config.train, config.data.max_target_len
    nat = run_config_lib.nat_of(config)
    if nat is not None:
        return NATSearch(max_len=max_len, iterations=nat.iterations, length_beam=nat.length_beam)
    return predict.SearchConfig(
        t.eval_search, max_len, beam_size=t.eval_beam_size, alpha=t.eval_alpha
    )
