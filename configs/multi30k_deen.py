"""Multi30k (task 1) German->English: configs/multi30k_ende.py with the languages swapped."""

import ml_collections

from configs import multi30k_ende


def get_config() -> ml_collections.ConfigDict:
    config = multi30k_ende.get_config()
    config.data.source_lang = "de"  # source language (file suffix)
    config.data.target_lang = "en"  # target language (file suffix)
    return config
