"""The project's errors: each becomes one `error: <message>` line and exit status 1, never a traceback.

This module sits at the bottom of the package and imports nothing, so a stage can catch every
error without importing the modules that raise them."""


class ConfigError(ValueError):
    """A params file that cannot be used; the message names the file and key."""


class DataError(ValueError):
    """Bad input data; the message names the file (and line) to fix."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, out of memory, a run that cannot resume)."""


class TrackingError(RuntimeError):
    """The MLflow tracking store cannot be used."""


ERRORS = (ConfigError, DataError, TrainingError, TrackingError)
