"""One error type the CLI turns into a one-line message (never a bare traceback)."""


class KilnError(Exception):
    """A problem the user can fix; the message names the file, record or key and what to do."""


class ConfigError(KilnError):
    """The configuration is invalid; raised before any work starts."""


class IntegrityError(KilnError):
    """A file on disk does not match the manifest that vouches for it."""
