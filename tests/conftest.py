"""Shared fixtures: a tiny run config that trains in seconds on a CPU."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # configs/ is a plain directory next to the package


def tiny_config(tfds_dir: str, **train_overrides):
    """The default run config shrunk to a 2-language, 0..99 task and a 1+1-layer model."""
    from configs.default import get_config

    config = get_config()
    m, d, t, o = config.model, config.data, config.train, config.optim
    m.d_model, m.num_heads, m.d_ff = 32, 2, 64
    m.num_encoder_layers = m.num_decoder_layers = 1
    m.dropout_rate = 0.0
    d.tfds_dir = tfds_dir
    d.languages = ("en", "de")
    d.max_number = 99
    d.valid_fraction = d.test_fraction = 0.1
    d.vocab_size = 64
    o.schedule, o.learning_rate, o.warmup_steps = "constant", 3e-3, 10
    t.batch_size, t.eval_batch_size = 16, 32
    t.num_steps, t.log_every, t.eval_every = 20, 5, 0
    t.checkpoint_every, t.keep_checkpoints = 10, 5
    t.num_examples_to_print = 2
    t.progress_bar, t.tensorboard = False, False
    for k, v in train_overrides.items():
        t[k] = v
    return config


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))
