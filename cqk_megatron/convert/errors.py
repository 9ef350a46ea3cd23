"""The one error type of conversion: its message names the file or field and the fix."""


class ConversionError(ValueError):
    """A checkpoint, folder, config or option that conversion cannot use."""
