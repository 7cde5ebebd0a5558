"""Errors that reach the user as one line (the CLI prints them without a traceback)."""


class MoestreamError(Exception):
    """An error the user can act on; str(e) says what is wrong and what to do."""


class ModelFileError(MoestreamError):
    """The model file is missing, damaged, or not one we can run."""


class BudgetError(MoestreamError):
    """The memory budget cannot hold what one token needs."""


class ContextError(MoestreamError):
    """The prompt (plus the tokens asked for) does not fit in the context."""


class ComputeError(MoestreamError):
    """A native kernel refused its arguments (a size, count or pointer out of range); `code` is its return code."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class DiskError(MoestreamError):
    """Reading the model file failed for good, or the file changed under the running process."""


class HubError(MoestreamError):
    """A model from the Hugging Face Hub could not be found, fetched or checked."""
