"""Multi30k English->German (configs/multi30k_ende.py) with the pointer-generator copy head.

Names, numbers and brand words of the English source often appear verbatim
in the German reference; the head can point at them instead of spelling
them from the vocabulary. The shared vocabulary is required (it is the
default of configs/multi30k_ende.py).
"""

import ml_collections

from configs import copy, multi30k_ende


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende.get_config()
    config.copy = copy.copy_section()  # the last decoder layer's cross-attention, all heads
    return config
