"""The one exception type for mistakes a user can fix.

The CLI catches it and prints a single line ``error: <what> (<how to fix>)`` with exit code 2.
Everything else is a failure nothing could have prevented (exit code 1).
"""


class UserError(Exception):
    """A mistake the user can fix: bad flag, missing file, wrong column, bad shape."""
