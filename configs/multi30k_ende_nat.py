"""Multi30k English->German with the non-autoregressive model (models/non_autoregressive.py).

configs/multi30k_ende.py's data, vocabulary and schedule with a `nat` section:
a CMLM decoder and a length classifier, evaluated with Mask-Predict (10
iterations, 3 length candidates). Non-autoregressive models are trained on
distilled targets: write them with distill.py from a trained multi30k_ende
workdir and pass the flags it prints.
"""

import ml_collections

from configs import multi30k_ende, nat


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende.get_config()
    config.train.exposure_report = False  # an autoregressive report
    config.train.eval_search = "greedy"  # unused: evaluation runs Mask-Predict

    config.nat = nat.nat_section(iterations=10, length_beam=3)  # evaluation's Mask-Predict
    return config
