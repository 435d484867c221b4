"""The name-copy task (configs/names.py) with the pointer-generator copy head.

Everything else is configs/names.py's, so the two train the same steps on the
same batches; docs/results.md compares them over three seeds.
"""

import ml_collections

from configs import copy, names


def get_config() -> ml_collections.ConfigDict:
    config = names.get_config()
    config.copy = copy.copy_section()  # the last decoder layer's cross-attention, all heads
    return config
