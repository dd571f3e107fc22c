"""``UsageError``: a mistake of the user's (an argument, a path, a config value, the job's data), not a bug.

The command line prints one as one ``error:`` line and exits with status 2; every other exception is
a bug (or a broken environment) and exits with status 1 and its traceback. It subclasses
``ValueError``, so Python callers that catch ``ValueError`` from a constructor or a data source keep
working. Standard library only: the command line raises it before torch loads.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A mistake the user can fix (the message says what and how); exit status 2 on the command line."""
