"""User-facing errors: the CLI prints these as one line, without a traceback."""


class DsparkError(Exception):
    """Base class for every error caused by bad input rather than a bug."""


class TargetLoadError(DsparkError):
    """The target model or its tokenizer could not be loaded."""


class DrafterLoadError(DsparkError):
    """The drafter could not be loaded or does not fit the target."""
