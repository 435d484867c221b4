"""Shared fixtures: a tiny run config that trains in seconds on a CPU.

tests/unit/ mirrors the package (one folder per subpackage): functions and modules on
arrays, in process. tests/e2e/ runs the commands and whole training runs; its tests carry
the `e2e` marker (`-m e2e` runs them alone, `-m "not e2e"` the unit tests alone).
"""

import atexit
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import numpy as np
import pytest

# The tests check what is computed, not how fast, and compiling dominates this suite on two
# cores. XLA:CPU's backend (LLVM) optimisations off roughly halve a compile; its element-wise
# loops emitted without the newer fusion emitters take half as long again (a tiny model's
# gradient: 1.0 s -> 0.5 s; tests/unit/models + search 109 s -> 69 s). Both are code
# generation only: the HLO passes, hence the arithmetic, are the same. Set before jax
# starts, so they reach this process and every train.py/decode.py the tests spawn.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_CHECKED = "FLAXFORMER_LITE_TEST_XLA_FLAGS"  # set once the flags were checked (workers inherit)


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib accepts `flag` (XLA aborts a process on an unknown flag)."""
    code = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    return probe.returncode == 0


if _CHECKED not in os.environ:
    _missing = [f for f in _FAST_COMPILE if f not in os.environ.get("XLA_FLAGS", "")]
    if _missing and not _xla_knows(" ".join(_missing)):  # one probe, then one per flag
        _missing = [f for f in _missing if _xla_knows(f)]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_missing]).strip()
    os.environ[_CHECKED] = "1"


def optimised_xla_flags() -> str:
    """The suite's XLA_FLAGS without its fast-compile flags, for a subprocess that runs a
    program many times (unoptimised code would take minutes)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f not in _FAST_COMPILE)


# Many tests compile the same tiny programs (a train step, a search) in fresh jit wrappers
# or in train.py subprocesses: JAX's persistent compilation cache, in a directory of this
# test worker alone, compiles each once. The executables are the same programs; only their
# compile time is saved. Subprocesses inherit it through the environment; those that run
# side by side (a multi-process job) are started without it (`without_compilation_cache`):
# the cache's files are not written atomically.
_JAX_CACHE = tempfile.mkdtemp(prefix="flaxformer-lite-jax-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
COMPILATION_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": _JAX_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
os.environ.update(COMPILATION_CACHE_ENV)


def without_compilation_cache(env: dict) -> dict:
    """`env` for a subprocess that must not share this worker's compilation cache.

    An empty JAX_COMPILATION_CACHE_DIR also keeps the CLIs off their default cache directory.
    """
    kept = {k: v for k, v in env.items() if k not in COMPILATION_CACHE_ENV}
    return {**kept, "JAX_COMPILATION_CACHE_DIR": ""}


def _enable_compilation_cache() -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", _JAX_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_enable_compilation_cache()


@pytest.fixture
def no_compilation_cache():
    """For tests that count compilations: every program is compiled, none read back."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # configs/ is a plain directory next to the package


def run_decode(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """`python decode.py *args` from the repository root on the CPU, `stdin` as its input."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "decode.py", *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        timeout=300,
    )


def tiny_config(tfds_dir: str, **train_overrides):
    """configs/tiny.py with its data under `tfds_dir` and train fields overridden."""
    from configs.tiny import get_config

    config = get_config()
    config.data.tfds_dir = tfds_dir
    config.train.tensorboard = False
    for k, v in train_overrides.items():
        config.train[k] = v
    return config


def tiny_model_config(**overrides):
    """A TransformerConfig small enough that one forward pass takes milliseconds.

    (`tiny_config` above is the run config; this is the model config alone.)
    """
    from flaxformer_lite.config import TransformerConfig

    fields = dict(
        vocab_size=29,
        d_model=32,
        num_heads=4,
        d_ff=48,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
    )
    return TransformerConfig(**(fields | overrides))


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def session_shared_dir(tmp_path_factory) -> pathlib.Path:
    """A directory of this test session that every pytest-xdist worker sees.

    Each worker's base temp dir is a child of the session's (pytest-xdist's documented
    pattern); without xdist the base temp dir is the session's own.
    """
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def build_once(tmp_path_factory, name: str, build: Callable[[pathlib.Path], None]) -> str:
    """`build(path)` run once per test session, whichever worker asks first; returns path.

    The others wait on a lock file next to it; a build that failed leaves no done-marker,
    so the next worker to ask starts it again from an empty directory.
    """
    shared = session_shared_dir(tmp_path_factory)
    path, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                build(path)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(path)


TRAINED_TINY_STEPS = 60  # checkpoints every 10 steps, the last 5 kept: 20, 30, 40, 50, 60


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory) -> str:
    """A workdir of configs/tiny.py trained for TRAINED_TINY_STEPS steps, once per session.

    For tests that only read a trained run (decoding, scoring, distilling, loading): it is
    shared by every test file on every worker, so a test that changes a workdir copies it
    first. Its data is prepared in a tfds dir of its own, next to it.
    """

    def train(path: pathlib.Path) -> None:
        from flaxformer_lite.config.run import parse
        from flaxformer_lite.training import loop

        config = tiny_config(str(path / "tfds"), num_steps=TRAINED_TINY_STEPS)
        loop.train_and_evaluate(parse(config), str(path / "run"), log=lambda s: None)

    return os.path.join(build_once(tmp_path_factory, "trained_tiny", train), "run")


def assert_params_close(got: dict, want: dict) -> None:
    """Parameters of two runs (name -> array) agree, key biases aside.

    Key biases add the same q.b to every score of a query, so softmax ignores them
    and their gradient is rounding noise, which Adam scales up to full-size steps:
    they differ between reduction orders without changing any output.
    """
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if name.endswith("['qkv_bias']"):
            a, b = a[[0, 2]], b[[0, 2]]  # [q, k, v] -> q and v
        elif name.endswith("['kv_bias']"):
            a, b = a[1], b[1]  # [k, v] -> v
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=name)


_E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e") + os.sep


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(_E2E):
            item.add_marker(pytest.mark.e2e)


def device_env(devices: int) -> dict:
    """This environment for a CPU process with `devices` simulated devices (the suite's
    other XLA flags kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))


def run_checks(script: str, devices: int, out, *args: str) -> tuple[dict, object, str]:
    """Runs `script` (argv: ROOT, *args, out) on `devices` simulated devices; it writes each
    check's outcome ("checked" or its traceback) to out/checks.json.

    Returns (outcome of each check, out, the process's output).
    """
    result = subprocess.run(
        [sys.executable, "-c", script, ROOT, *args, str(out)],
        env=device_env(devices),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads((out / "checks.json").read_text()), out, result.stdout


def assert_checked(checked: tuple[dict, object, str], name: str) -> None:
    """Check `name` of a `run_checks` result passed (else its traceback and the output)."""
    outcome, _, stdout = checked
    assert outcome[name] == "checked", f"{outcome[name]}\n{stdout[-3000:]}"
