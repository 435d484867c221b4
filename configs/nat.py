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


def ctc_section(
    upsample_ratio: float = 3.0, glance_steps: int = 300_000
) -> ml_collections.ConfigDict:
    """The `nat` section of the CTC decoder (models/ctc_nat.py): `upsample_ratio` decoder
    positions per source token reading a copy of the source, the CTC loss with glancing
    annealed 0.5 -> 0.3 over `glance_steps`, argmax-and-collapse decoding."""
    return defaults.section_config(
        "nat",
        objective="ctc",
        decoder_inputs="copy",
        upsample_ratio=upsample_ratio,
        glance_steps=glance_steps,
    )


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.train.exposure_report = False  # an autoregressive report: no prefix to swap here
    config.nat = nat_section()
    return config
