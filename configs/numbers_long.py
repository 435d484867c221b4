"""Long outputs for exposure bias: English numbers up to 10^9 in words (20-30 target tokens).

20,000 numbers drawn uniformly from 0..999,999,999 (nearly all of them 9 digits), 1,000 held
out for validation and 1,000 for test. One wrong piece early in
"nine hundred and eighty-seven million, six hundred and ..." changes what the decoder reads for
the rest of the output, so free-running decoding can fall behind teacher forcing: the task of
the scheduled-sampling comparison in docs/methods.md. A small model, for minutes on 2 CPU cores.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    m, d, o, t = config.model, config.data, config.optim, config.train
    m.d_model, m.num_heads, m.d_ff = 128, 4, 512  # width, heads, feed-forward size
    m.num_encoder_layers = m.num_decoder_layers = 2  # depth
    m.dropout_rate = 0.1  # P_drop
    n = d.number_words
    n.languages = ("en",)  # English: a piece per word, ~25 pieces at 9 digits
    n.max_number = 999_999_999  # numbers below 10^9
    n.num_numbers = 20_000  # drawn uniformly: 18,000 train, 1,000 validation, 1,000 test
    n.always_train_below, n.shape_balance = 0, 0.0  # every drawn number may be held out
    d.valid_fraction = d.test_fraction = 0.05
    d.vocab_size = 256  # SentencePiece pieces
    d.max_source_len = 14  # "de" + up to 9 digits + EOS
    d.max_target_len = 28  # the longest outputs are 25 pieces with EOS
    o.schedule = "rsqrt"  # the paper's warm-up and inverse square root decay
    o.learning_rate, o.warmup_steps = 1.0, 300  # peak 5e-3 at step 300
    t.num_steps = 1200  # optimiser steps
    t.eval_every, t.checkpoint_every = 600, 600
    t.num_examples_to_print = 4
    return config
