"""Errors a user can fix. The CLI prints their message on one line and exits 2."""


class ConfigError(ValueError):
    """A user-facing configuration or input problem; the message says what would be right."""


class ModelDirError(ConfigError):
    """A model directory is missing, partial, or holds weights we refuse to load."""
