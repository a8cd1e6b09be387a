"""The error for an engine setting read from a `KVFLEET_*` environment variable.

Such settings are read when their module is imported or the engine starts, before any request: the command line
catches this error and prints its one line (the variable, the value, what it takes) instead of a traceback. The
kernels, which import nothing of the engine's, raise a plain ValueError naming the variable at import; the command
line treats any ValueError from importing our modules as such a setting.
"""

from __future__ import annotations


class EnvSettingError(ValueError):
    """A `KVFLEET_*` variable holds a value the engine cannot use; the message starts with the variable's name."""
