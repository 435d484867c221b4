"""The command-line tools' shared helpers, and what each command does with its flag values."""
