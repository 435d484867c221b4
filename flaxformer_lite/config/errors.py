"""The one error a bad setting raises."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it.

    The command-line tools print its one line instead of a traceback.
    """
