"""A seconds-long smoke run: the default task shrunk to English/German 0..99, 1+1 layers."""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    m, d, o, t = config.model, config.data, config.optim, config.train
    m.d_model, m.num_heads, m.d_ff = 32, 2, 64  # width, heads, feed-forward size
    m.num_encoder_layers = m.num_decoder_layers = 1  # depth
    m.dropout_rate = 0.0  # no regularisation needed for a smoke run
    n = d.number_words
    n.languages = ("en", "de")  # two languages
    n.max_number = 99  # numbers 0..99
    n.always_train_below, n.shape_balance = 0, 0.0  # any number may be held out; each seen once
    d.valid_fraction = d.test_fraction = 0.1  # 20 + 20 held-out pairs
    d.vocab_size = 64  # SentencePiece pieces
    o.schedule, o.learning_rate, o.warmup_steps = "constant", 3e-3, 10  # fast warm-up
    t.batch_size, t.eval_batch_size = 16, 32  # examples per train / eval batch
    t.num_steps, t.log_every, t.eval_every = 20, 5, 0  # 20 steps, log every 5, eval at end
    t.checkpoint_every, t.keep_checkpoints = 10, 5  # checkpoints at 10 and 20
    t.num_examples_to_print = 2  # test examples shown at the end
    t.exposure_report = False  # smoke runs compile no report functions
    t.progress_bar, t.tensorboard = False, True  # quiet terminal, event files on
    return config
