"""The coordinator's run-time error: an iteration that could not complete."""


class IterationError(RuntimeError):
    """An iteration could not complete; the message says which service and why."""
