"""The embedded default: numbers in digits -> words in English, German and French.

Generated locally (no download); a small Transformer learns it on 2 CPU cores
in a few minutes. `python train.py` uses this config.

Every field starts at its dataclass default (flaxformer_lite/config/, each listed with
its comment in docs/configuration.md); the data, optim, train and mesh defaults are this
task's. Set here is only what the task wants otherwise: the model, whose dataclass
defaults are the paper's base model.
"""

import ml_collections

from flaxformer_lite.config import defaults


def get_config() -> ml_collections.ConfigDict:
    config = defaults.base_config()
    m = config.model
    m.vocab_size = 256  # replaced by the trained tokenizer's size
    m.d_model = 128  # a quarter of the paper's base: the task has a 60-piece vocabulary
    m.num_heads = 4
    m.d_ff = 512
    m.num_encoder_layers = 2  # N = 2 of the paper's 6: enough to reorder German units/tens
    m.num_decoder_layers = 2
    m.dropout_rate = 0.0  # the task has no noise
    m.max_len = 64  # rows of the learned-position table (unused by sinusoids)
    m.dtype = "auto"  # bfloat16 on GPUs and TPUs, float32 on CPUs
    return config
