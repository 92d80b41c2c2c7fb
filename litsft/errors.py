"""The one exception type for mistakes a user can fix."""


class LitsftError(Exception):
    """A user error: bad config, bad data, bad checkpoint. The CLI prints its message on one line and
    exits non-zero without a traceback, so the message must name the bad value and the fix."""
