"""Shared fixtures: a tiny run config that trains in seconds on a CPU."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # configs/ is a plain directory next to the package


def tiny_config(tfds_dir: str, **train_overrides):
    """configs/tiny.py with its data under `tfds_dir` and train fields overridden."""
    from configs.tiny import get_config

    config = get_config()
    config.data.tfds_dir = tfds_dir
    config.train.tensorboard = False
    for k, v in train_overrides.items():
        config.train[k] = v
    return config


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))
