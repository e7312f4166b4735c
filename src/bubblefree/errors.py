"""The one exception type that means "the user asked for something invalid".

The CLI turns a ``UserError`` (and a ``ValueError`` raised while a run is being set up, which is how the
library reports invalid arguments) into one line on stderr and exit code 2; anything else is a bug (exit 1).
"""

__all__ = ["UserError"]


class UserError(ValueError):
    """Invalid input: an unknown name, a bad value, a missing or corrupt file. The message is shown as is."""
