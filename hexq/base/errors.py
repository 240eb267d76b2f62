"""The one exception type the CLI turns into a one-line message and exit code 1."""


class HexqError(ValueError):
    """A user-facing error: the message says what is wrong and what to change."""
