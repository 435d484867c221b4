"""The embedded number task with the non-autoregressive model (models/non_autoregressive.py).

The default config's data, model size and schedule, plus a `nat` section: a
CMLM decoder (k ~ U{1..n} target tokens masked per row) with a length
classifier, evaluated with Mask-Predict. To train on an autoregressive
model's beam outputs instead of the gold targets (sequence-level knowledge
distillation), write them with distill.py and pass the flags it prints.
"""

import ml_collections

from configs import default
from flaxformer_lite.config import defaults


def nat_section(iterations: int = 4, length_beam: int = 1) -> ml_collections.ConfigDict:
    """The `nat` section (config/variants.NATConfig): CMLM training, a length classifier, and
    in evaluation Mask-Predict with `iterations` decoder calls (1: single pass) over
    `length_beam` length candidates."""
    return defaults.section_config("nat", iterations=iterations, length_beam=length_beam)


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.train.exposure_report = False  # an autoregressive report: no prefix to swap here
    config.nat = nat_section()
    return config
