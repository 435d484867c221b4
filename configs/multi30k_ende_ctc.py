"""Multi30k English->German with the CTC non-autoregressive model (models/ctc_nat.py).

configs/multi30k_ende.py's data, vocabulary, model and schedule with a `nat`
section of objective "ctc": the decoder reads the source embeddings upsampled
3x (up to 192 positions for 64 source tokens), is trained with the CTC loss
and glancing (ratio 0.5 -> 0.3 over the whole run), and decodes in one pass
(argmax, merge repeats, drop blanks). Like every non-autoregressive model it
is best trained on distilled targets: configs/multi30k_ende_ctc_distilled.py.
"""

import ml_collections

from configs import multi30k_ende, nat


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende.get_config()
    t = config.train
    t.exposure_report = False  # an autoregressive report
    t.eval_search = "greedy"  # unused: evaluation decodes the CTC way
    t.label_smoothing = 0.0  # the CTC loss has no labels to smooth

    config.nat = nat.ctc_section(upsample_ratio=3.0, glance_steps=t.num_steps)
    return config
