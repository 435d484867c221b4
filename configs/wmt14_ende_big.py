"""Transformer big (Vaswani et al. 2017, Table 3 "big") for WMT14 English->German.

d_model=1024, d_ff=4096, h=16, P_drop=0.3, trained 300k steps (§5.2, §6.1).
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
    config = wmt14_ende_base.get_config()
    m = config.model
    m.d_model = 1024
    m.num_heads = 16
    m.d_kv = 64  # still d_model / h: more heads, not wider ones
    m.d_ff = 4096
    m.dropout_rate = 0.3  # the big model's P_drop for EN-DE (EN-FR used 0.1)
    config.train.num_steps = 300_000  # big model: 300k steps
    return config
