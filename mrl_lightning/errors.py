"""Errors with a message meant for the user (the CLI prints them without a traceback)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and the fix."""
