"""The one exception type for mistakes a user can fix.

Anything raised as :class:`LongtrainError` is printed by the command line as a single
line (no traceback) and exits with a non-zero code, so every message must name the
problem *and* the fix.
"""


class LongtrainError(Exception):
    """A user-fixable problem: bad input, an unsupported combination, a corrupt file."""
