"""The number task with the pointer-generator copy head, and the `copy` section for others.

`copy_section()` is added to another config by configs/names_copy.py and
configs/multi30k_ende_copy.py; with it the model mixes its vocabulary softmax
with the cross-attention of one decoder layer (P = p_gen P_vocab + (1 - p_gen)
P_copy), and source pieces the vocabulary cannot spell get extended ids.
"""

import ml_collections


def copy_section(layer: int = -1, heads: tuple[int, ...] = ()) -> ml_collections.ConfigDict:
    """The `copy` section: which decoder layer's cross-attention is copied, and its heads."""
    c = ml_collections.ConfigDict()
    c.layer = layer  # decoder layer whose cross-attention is the copy distribution (-1: last)
    c.heads = heads  # heads averaged into it; () = all of them
    return c


def get_config() -> ml_collections.ConfigDict:
    """The embedded number task with the copy head (its digits are copied, not spelled)."""
    from configs import default

    config = default.get_config()
    config.copy = copy_section()
    return config
