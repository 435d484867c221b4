"""Multi30k English->German with the non-autoregressive model (models/non_autoregressive.py).

configs/multi30k_ende.py's data, vocabulary and schedule with a `nat` section:
a CMLM decoder and a length classifier, evaluated with Mask-Predict (10
iterations, 3 length candidates). Non-autoregressive models are trained on
distilled targets: write them with distill.py from a trained multi30k_ende
workdir and pass the flags it prints.
"""

import ml_collections

from configs import multi30k_ende


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende.get_config()
    config.train.exposure_report = False  # an autoregressive report
    config.train.eval_search = "greedy"  # unused: evaluation runs Mask-Predict

    config.nat = n = ml_collections.ConfigDict()
    n.length_mode = "predict"  # predict (a classifier on the encoder) | fixed (cut at first EOS)
    n.length_classes = 256  # offsets target - source in [-128, 128), as fairseq
    n.length_loss_weight = 0.1  # of the length loss, next to the token loss (fairseq's 0.1)
    n.length_stop_gradient = False  # True: the length loss does not train the encoder
    n.decoder_inputs = "mask"  # mask (a row of mask tokens) | copy (uniform source copy)
    n.masking = "uniform"  # uniform (CMLM: k ~ U{1..n} masked) | all (single-pass NAT)
    n.iterations = 10  # evaluation: Mask-Predict decoder calls (1: single pass)
    n.length_beam = 3  # evaluation: length candidates decoded in parallel
    return config
