"""The embedded number task with the non-autoregressive model (models/non_autoregressive.py).

The default config's data, model size and schedule, plus a `nat` section: a
CMLM decoder (k ~ U{1..n} target tokens masked per row) with a length
classifier, evaluated with Mask-Predict. To train on an autoregressive
model's beam outputs instead of the gold targets (sequence-level knowledge
distillation), write them with distill.py and pass the flags it prints.
"""

import ml_collections

from configs import default


def nat_section(iterations: int = 4, length_beam: int = 1) -> ml_collections.ConfigDict:
    """The `nat` section: CMLM training, a length classifier, Mask-Predict in evaluation."""
    n = ml_collections.ConfigDict()
    n.length_mode = "predict"  # predict (a classifier on the encoder) | fixed (cut at first EOS)
    n.length_classes = 256  # offsets target - source in [-128, 128), as fairseq
    n.length_loss_weight = 0.1  # of the length loss, next to the token loss (fairseq's 0.1)
    n.length_stop_gradient = False  # True: the length loss does not train the encoder
    n.decoder_inputs = "mask"  # mask (a row of mask tokens) | copy (uniform source copy)
    n.masking = "uniform"  # uniform (CMLM: k ~ U{1..n} masked) | all (single-pass NAT)
    n.iterations = iterations  # evaluation: Mask-Predict decoder calls (1: single pass)
    n.length_beam = length_beam  # evaluation: length candidates decoded in parallel
    return n


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.train.exposure_report = False  # an autoregressive report: no prefix to swap here
    config.nat = nat_section()
    return config
