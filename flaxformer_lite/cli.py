"""Shared command-line plumbing: one clear error line instead of a traceback wall."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

# Errors that mean "the user asked for something wrong": printed as one line.
USER_ERRORS: tuple[type[BaseException], ...] = ()


def user_errors() -> tuple[type[BaseException], ...]:
    from flaxformer_lite.checkpoints import CheckpointIntegrityError, WorkdirError
    from flaxformer_lite.config import ConfigError

    return (ConfigError, WorkdirError, CheckpointIntegrityError, FileNotFoundError)


def friendly_errors(main: Callable) -> Callable:
    """Wraps an absl `main` so that user errors exit with status 2 and one line on stderr.

    Set FLAXFORMER_LITE_TRACEBACK=1 to see the full traceback.
    """

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except user_errors() as e:
            if os.environ.get("FLAXFORMER_LITE_TRACEBACK"):
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapped
