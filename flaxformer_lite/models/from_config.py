"""The model kind and the evaluation search a run config describes.

A run config without a `nat` section trains the autoregressive model
(`models/autoregressive.py`); with one, a non-autoregressive model: Mask-Predict's
(`models/non_autoregressive.py`) or with `nat.objective="ctc"` the CTC decoder
(`models/ctc_nat.py`); with a `copy` section, the autoregressive
model with the pointer-generator head. Training, `decode.py` and `--dry_run` build
the model here, so a workdir decodes with the kind it was trained as.
"""

from __future__ import annotations

from flaxformer_lite.config.run import RunConfig
from flaxformer_lite.models import predict
from flaxformer_lite.models.autoregressive import AutoregressiveModel
from flaxformer_lite.models.base import Seq2SeqModel
from flaxformer_lite.models.ctc_nat import CTCModel
from flaxformer_lite.models.non_autoregressive import NATSearch, NonAutoregressiveModel


def build_model(run: RunConfig) -> Seq2SeqModel:
    """The run's model behind the protocol, of `run.model`'s sizes."""
    if run.nat is None:
        return AutoregressiveModel(
            run.model,
            label_smoothing=run.train.label_smoothing,
            scheduled_sampling=run.scheduled_sampling,
            copy=run.copy,
            guided_attention=run.guided_attention,
        )
    nat = run.nat
    if nat.objective == "ctc":
        return CTCModel(
            run.model,
            upsample_ratio=nat.upsample_ratio,
            glance_start=nat.glance_start,
            glance_end=nat.glance_end,
            glance_steps=nat.glance_steps,
        )
    return NonAutoregressiveModel(
        run.model,
        label_smoothing=run.train.label_smoothing,
        length_mode=nat.length_mode,
        length_classes=nat.length_classes,
        length_loss_weight=nat.length_loss_weight,
        length_stop_gradient=nat.length_stop_gradient,
        decoder_inputs=nat.decoder_inputs,
        masking=nat.masking,
    )


def search_from_config(run: RunConfig) -> predict.SearchConfig | NATSearch:
    """The search evaluation decodes with."""
    t, max_len = run.train, run.data.max_target_len
    if run.nat is not None and run.nat.objective == "ctc":
        return NATSearch(max_len=max_len)  # one pass, no length to choose
    if run.nat is not None:
        return NATSearch(
            max_len=max_len, iterations=run.nat.iterations, length_beam=run.nat.length_beam
        )
    return predict.SearchConfig(
        t.eval_search, max_len, beam_size=t.eval_beam_size, alpha=t.eval_alpha
    )
