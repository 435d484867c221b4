"""The name-copy task (flaxformer_lite/data/names.py): repeat a name or code from the source.

"hi , i am Kuroro" -> "hello Kuroro , nice to meet you". 20,000 generated training pairs;
the 500 validation and 1,000 test pairs use names that share no word with training, and half
of them hold characters (ž, ø, Å, ...) that the training split, hence the vocabulary, lacks.
The default model size, 1500 steps (10 minutes on 2 CPU cores shared with other jobs, test
exact match 0.497 of at most 0.5: see docs/results.md); checkpoints ranked by exact match. Score
the copied spans of decoded outputs with flaxformer_lite/evaluation/copy_spans.py.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    m, d, o, t = config.model, config.data, config.optim, config.train
    m.d_model, m.num_heads, m.d_ff = 128, 4, 512  # width, heads, feed-forward size
    m.num_encoder_layers = m.num_decoder_layers = 2  # depth
    m.dropout_rate = 0.0  # names are unlimited: no example is seen twice to overfit
    d.dataset = "names"
    d.names.train, d.names.valid, d.names.test = 20_000, 500, 1_000  # examples per split
    d.seed = 0  # seed of the generated names and templates
    d.vocab_size = 256  # shared SentencePiece pieces: template words, syllables, digits
    d.max_source_len = d.max_target_len = 32  # the longest pairs are 23 pieces with EOS
    d.batching = "bucket"  # rows of 16 or 32 pieces: twice the steps per second of fixed 32
    o.schedule, o.learning_rate, o.warmup_steps = "cosine", 3e-3, 100
    t.batch_size = 64  # examples per step
    t.num_steps = 1500  # optimiser steps
    t.eval_every = t.checkpoint_every = 500
    t.best_metric = "exact_match"  # rank checkpoints by validation exact match
    t.num_examples_to_print = 8
    return config
