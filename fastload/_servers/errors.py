"""The one error type of the test servers."""


class ServerError(RuntimeError):
    """A test server or shaped link could not be started or stopped."""
