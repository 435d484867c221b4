"""Transformer big (Vaswani et al. 2017, Table 3 "big") for WMT14 English->German.

d_model=1024, d_ff=4096, h=16, P_drop=0.3, trained 300k steps (§5.2, §6.1).
"""

import ml_collections

from configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
    config = wmt14_ende_base.get_config()
    m = config.model
    m.d_model = 1024  # d_model
    m.num_heads = 16  # h
    m.d_kv = 64  # d_k = d_v = d_model / h
    m.d_ff = 4096  # d_ff
    m.dropout_rate = 0.3  # P_drop (EN-DE big)
    config.train.num_steps = 300_000  # big model: 300k steps
    return config
