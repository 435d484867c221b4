"""The CLIs' persistent compilation cache: a second process loads what the first compiled."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from flaxformer_lite.cli import compilation_cache
from flaxformer_lite.config import ConfigError

PROGRAM = """
import sys
import jax
import jax.numpy as jnp
from flaxformer_lite.cli import compilation_cache

compilation_cache.enable(sys.argv[1], log=lambda line: print("LOG", line))
print(float(jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).sum()))
"""


def _run(cache_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # this worker's own cache
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, cache_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_second_process_loads_the_program_and_says_so_once(tmp_path):
    cache_dir = str(tmp_path / "cache")
    first = _run(cache_dir)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "LOG" not in first.stdout  # nothing to load yet
    assert os.listdir(cache_dir)  # the compiled program was written
    second = _run(cache_dir)
    assert second.returncode == 0, second.stderr[-2000:]
    logged = [line for line in second.stdout.splitlines() if line.startswith("LOG")]
    assert logged == [
        f"LOG compilation cache: loading compiled programs from {cache_dir} "
        "(--compilation_cache_dir= turns it off)"
    ]
    assert second.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]  # the same result


def test_an_empty_directory_turns_the_cache_off(tmp_path):
    off = _run("")
    assert off.returncode == 0, off.stderr[-2000:]
    assert "LOG" not in off.stdout


def test_default_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path / "flaxformer_lite" / "jax")
    monkeypatch.setenv(compilation_cache.ENV, "")
    assert compilation_cache.default_dir() == ""  # set but empty: off


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_a_directory_that_cannot_be_written_is_one_clear_error(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    path = str(blocker if where == "a_file" else blocker / "cache")
    with pytest.raises(ConfigError, match=r"--compilation_cache_dir: .* --compilation_cache_dir="):
        compilation_cache.enable(path)


def test_train_cli_rejects_a_bad_cache_directory_before_training(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            f"--compilation_cache_dir={blocker}",
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: --compilation_cache_dir: {str(blocker)!r} exists and is not a directory; "
        "pass a writable directory, or --compilation_cache_dir= to turn the cache off"
    )
    assert not os.path.exists(tmp_path / "run")
