"""JAX's persistent compilation cache for the command-line tools.

Without it every start of `train.py` or `decode.py` compiles its programs
anew: tens of seconds on a CPU, minutes for a large model on an accelerator.
With it a second start loads the executables XLA wrote the first time. The
key covers the program, the compiler options, the devices and the jax/jaxlib
versions, so a changed model or an upgraded jax compiles again rather than
loading something stale.

The directory is `--compilation_cache_dir` (default below); an empty value
turns the cache off. Only process 0 of a multi-process job writes entries
(JAX's rule); a reader that catches an entry still being written gets a
warning from JAX and compiles instead.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

FLAG = "compilation_cache_dir"
# JAX reads this variable itself; the CLIs take it as their default, so that a
# caller (a test worker, a cluster launcher) can point every tool at one place.
ENV = "JAX_COMPILATION_CACHE_DIR"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR when set (empty: off), else $XDG_CACHE_HOME/flaxformer_lite/jax.

    XDG_CACHE_HOME defaults to ~/.cache.
    """
    if ENV in os.environ:
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flaxformer_lite", "jax")


def define_flag(off_because: str | None = None) -> None:
    """Defines `--compilation_cache_dir` (absl) defaulting to `default_dir()`.

    With `off_because`, only $JAX_COMPILATION_CACHE_DIR turns it on by default.
    """
    from absl import flags

    if off_because:
        default = os.environ.get(ENV, "")
        said = f"Default: ${ENV} when set, else off, {off_because}."
    else:
        default = default_dir()
        said = f"Default: ${ENV} when set, else $XDG_CACHE_HOME/flaxformer_lite/jax (~/.cache/...)."
    flags.DEFINE_string(
        FLAG,
        default,
        "Directory of JAX's persistent compilation cache: a later start loads the programs "
        f"compiled here instead of compiling them again. Empty turns it off. {said}",
    )


def _check_writable(path: str) -> None:
    """Raises ConfigError unless `path` is (or can be made) a directory this process writes."""
    from flaxformer_lite.config import ConfigError

    fix = f"pass a writable directory, or --{FLAG}= to turn the cache off"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--{FLAG}: {path!r} exists and is not a directory; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
        # JAX would only warn on a failed write and compile on; probe it once instead.
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"--{FLAG}: cannot write to {path!r} ({e.strerror}); {fix}") from None


def enable(path: str, log: Callable[[str], None] | None = None) -> bool:
    """Points JAX's persistent compilation cache at `path` ("" turns it off); True if on.

    Call before the first compilation: JAX decides once per process whether a
    cache is used. Every program is cached whatever its compile time or size
    (reading an entry costs milliseconds). The first time a program is loaded
    from the cache, `log` (stderr by default) gets one line saying so.

    Raises:
      ConfigError: `path` is not a directory this process can write.
    """
    import jax

    if not path:
        jax.config.update("jax_enable_compilation_cache", False)
        return False
    path = os.path.abspath(os.path.expanduser(path))
    _check_writable(path)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _report_first_hit(path, log or (lambda s: print(s, file=sys.stderr, flush=True)))
    return True


def _report_first_hit(path: str, log: Callable[[str], None]) -> None:
    import jax

    reported = []

    def listener(event: str, **kwargs) -> None:
        if event == HIT_EVENT and not reported:
            reported.append(True)
            log(
                f"compilation cache: loading compiled programs from {path} (--{FLAG}= turns it off)"
            )

    jax.monitoring.register_event_listener(listener)
