"""Errors of the runtime a user can fix (see planner/errors.py for ConfigError itself)."""

from planner.errors import ConfigError


class ModelDirError(ConfigError):
    """A model directory is missing, partial, or holds weights we refuse to load."""
