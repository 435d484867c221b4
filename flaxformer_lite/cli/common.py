"""Shared command-line plumbing: one clear error line instead of a traceback wall.

Set FLAXFORMER_LITE_TRACEBACK=1 to see full tracebacks.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable

from absl import flags

from flaxformer_lite.training.workdir import WorkdirError

TRACEBACK_ENV = "FLAXFORMER_LITE_TRACEBACK"


def fail(message: str, code: int = 2):
    """Prints `error: message` on stderr and exits.

    The error line is the last thing printed: what a failed checkpoint write left
    behind (orbax's unretrieved asyncio futures, never-awaited coroutines) would
    otherwise log its tracebacks when the interpreter collects it at exit.
    """
    print(f"error: {message}", file=sys.stderr)
    sys.stderr.flush()
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")
    warnings.filterwarnings("ignore", message="Enable tracemalloc")
    sys.exit(code)


def _flag_value(argv: list[str], flag: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{flag}="):
            return arg.split("=", 1)[1]
        if arg == f"--{flag}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def check_config_overrides(argv: list[str], default_path: str, flag: str = "config") -> None:
    """Rejects `--config.a.b=v` flags that name no field of the config file, naming the fix."""
    if any(a in ("-h", "--help", "--helpfull", "--helpshort") for a in argv):
        return
    path = _flag_value(argv, flag, default_path)
    if not os.path.isfile(path):
        fail(f"--{flag}: config file {path!r} does not exist; pass a path like configs/default.py")
    spec = importlib.util.spec_from_file_location("_cli_config", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config()
    except Exception as e:  # a broken config file: say which and why
        fail(f"--{flag}: could not load {path!r}: {type(e).__name__}: {e}")
    prefix = f"--{flag}."
    for arg in argv:
        if not arg.startswith(prefix):
            continue
        key = arg[len(prefix) :].split("=", 1)[0]
        node = config
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not hasattr(node, "keys") or part not in node:
                where = ".".join(parts[:depth]) or "the config"
                known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none"
                fail(
                    f"unknown config key {key!r} in {path}: {where} has no field {part!r} "
                    f"({_moved(key) or f'fields: {known}'})"
                )
            node = node[part]


def _moved(key: str) -> str | None:
    """Where a `data` field of an earlier version went ("it is now data.names.train")."""
    from flaxformer_lite.config.sections import MOVED_DATA_FIELDS

    section, _, name = key.partition(".")
    if section == "data" and name in MOVED_DATA_FIELDS:
        return f"it is now data.{MOVED_DATA_FIELDS[name]}"
    return None


def define_host_malloc_flag() -> None:
    from flaxformer_lite.cli import host_memory

    flags.DEFINE_enum(
        "host_malloc",
        "auto",
        host_memory.MODES,
        "reuse: keep freed host memory in the process, so XLA:CPU does not map and zero "
        "its scratch memory anew every step (~7% faster CPU training steps, ~30% slower "
        "compiles); system: leave malloc alone; auto: reuse unless a GPU/TPU plugin is "
        "installed.",
    )


def set_host_malloc(argv: list[str]) -> None:
    """Applies `--host_malloc` (see `host_memory`); call it before anything imports JAX."""
    from flaxformer_lite.cli import host_memory

    try:
        host_memory.configure(_flag_value(argv, "host_malloc", "auto"))
    except ValueError as e:
        fail(f"--{e}")


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parser for `app.run(..., flags_parser=...)` with one-line errors."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}; see --help")
    except Exception as e:  # ml_collections raises plain errors for bad overrides
        if os.environ.get(TRACEBACK_ENV):
            raise
        fail(f"bad flag value: {type(e).__name__}: {e}")


def user_errors() -> tuple[type[BaseException], ...]:
    from flaxformer_lite.config import ConfigError
    from flaxformer_lite.training import checkpoint_format
    from flaxformer_lite.training.restore import StepSpecError

    return (
        ConfigError,
        WorkdirError,
        checkpoint_format.CheckpointIntegrityError,
        checkpoint_format.CheckpointFormatError,
        checkpoint_format.CheckpointWriteError,
        StepSpecError,
        FileNotFoundError,
    )


def friendly_errors(main: Callable) -> Callable:
    """Wraps an absl `main` so that user errors exit with status 2 and one line on stderr."""

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except user_errors() as e:
            if os.environ.get(TRACEBACK_ENV):
                raise
            fail(str(e))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapped


def visible_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H200 (UUID: ...)"); [] without a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        result = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if result.returncode != 0:
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.startswith("GPU ")]


def report_platform(log: Callable[[str], None] | None = None) -> str:
    """Logs `running on <platform>: <n> device(s)`; returns the platform ("cpu", "gpu", "tpu").

    When JAX runs on the CPU although `nvidia-smi` sees a GPU, also logs a
    warning naming the fix: the default `pip install -e .` installs the CPU-only
    jaxlib, and a run on the wrong device is otherwise noticed only by its speed.
    """
    import jax

    log = log or (lambda s: print(s, file=sys.stderr))
    platform = jax.default_backend()
    log(f"running on {platform}: {jax.device_count()} device(s)")
    if platform == "cpu":
        gpus = visible_gpus()
        if gpus:
            forced = os.environ.get("JAX_PLATFORMS", "")
            fix = (
                f"unset JAX_PLATFORMS={forced}"
                if forced and not any(p in forced for p in ("cuda", "gpu"))
                else 'install JAX\'s CUDA build: pip install -e ".[cuda12]"'
            )
            log(
                f"warning: JAX runs on the CPU, but nvidia-smi lists {len(gpus)} GPU(s) "
                f"({gpus[0]}); {fix}"
            )
    return platform
