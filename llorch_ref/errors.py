"""One exception type per kind of failure. The CLI prints `error: <message>` and exits 2."""


class LlorchError(Exception):
    """Base class: every error llorch-ref raises on purpose is one of these."""


class ModelFileError(LlorchError):
    """The model file or folder is missing, unreadable, truncated or malformed."""


class UnsupportedModelError(LlorchError):
    """The file is well-formed but describes something llorch-ref does not implement."""


class ChecksumError(LlorchError):
    """A downloaded or cached file does not have the expected sha256."""


class DownloadError(LlorchError):
    """The default model could not be fetched."""


class TokenizerError(LlorchError):
    """The vocabulary cannot be turned into a tokenizer, or text cannot be encoded."""


class PromptError(LlorchError):
    """The prompt is empty, too long for the context, or otherwise unusable."""


class ParameterError(LlorchError):
    """A user-supplied parameter is out of range or not supported."""


class ReferenceError_(LlorchError):
    """An independent reference engine (llama.cpp, transformers) is missing or misbehaved."""


class HarnessError(LlorchError):
    """A checkpoint spec, bundle or comparison is malformed."""


class BlackBoxError(LlorchError):
    """A black-box engine under test (an OpenAI-compatible server, mistral.rs) did not answer, answered an error,
    or returned tokens and log-probabilities that do not fit the request or the model."""


class DumpError(LlorchError):
    """A tensor dump (llorch-dump format) or its manifest is malformed or does not fit the model."""


class OutputPathError(LlorchError):
    """An output path cannot be written, or writing it would replace an input or something the command did not create."""


class SamplingError(LlorchError):
    """The sampler met a distribution it cannot draw from (a bug: every accepted parameter must be safe)."""
