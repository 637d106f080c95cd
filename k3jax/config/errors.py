"""The one exception type for bad user input (config keys, files, shapes, checkpoints)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A problem in user input, with the place it came from.

    `where` names the place: a config file and dotted key, a data path, a checkpoint.
    Command-line tools print `str(err)` and exit 2, never a traceback.
    """

    def __init__(self, message: str, where: str | None = None):
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)
