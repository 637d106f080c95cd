"""The interchange's one error type."""


class InterchangeError(ValueError):
    """A checkpoint or run directory that cannot be converted; the message names the tensor,
    file or config key at fault."""
