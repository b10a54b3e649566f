"""The one exception every bad checkpoint turns into."""


class ModelLoadError(ValueError):
    """A model path that cannot be loaded. The message names the file, tensor or setting at fault and
    what is supported, so the user can act on it without reading a traceback."""
