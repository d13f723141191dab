"""The converter's one exception type (kept import-light: no jax/numpy)."""


class ConversionError(ValueError):
    """The input cannot be converted; the message says what is wrong and where."""
