"""The number task with the pointer-generator copy head, and the `copy` section for others.

`copy_section()` is added to another config by configs/names_copy.py and
configs/multi30k_ende_copy.py; with it the model mixes its vocabulary softmax
with the cross-attention of one decoder layer (P = p_gen P_vocab + (1 - p_gen)
P_copy), and source pieces the vocabulary cannot spell get extended ids.
"""

import ml_collections

from flaxformer_lite.config import defaults


def copy_section(layer: int = -1, heads: tuple[int, ...] = ()) -> ml_collections.ConfigDict:
    """The `copy` section (config/variants.CopyHead): the decoder layer whose cross-attention
    is the copy distribution (-1: the last) and the heads averaged into it ((): all)."""
    return defaults.section_config("copy", layer=layer, heads=heads)


def get_config() -> ml_collections.ConfigDict:
    """The embedded number task with the copy head (its digits are copied, not spelled)."""
    from configs import default

    config = default.get_config()
    config.copy = copy_section()
    return config
