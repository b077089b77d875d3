"""Errors a user can fix. The CLI prints their message on one line and exits 2.

Defined here, at the bottom of the layering (ditango_cli -> slurm -> runtime -> planner), so
that every layer can raise them."""


class ConfigError(ValueError):
    """A user-facing configuration or input problem; the message says what would be right."""
