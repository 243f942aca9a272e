"""The errors of the variant library (``variants.VariantError``, ``variants.UnsupportedBackend``)."""


class VariantError(ValueError):
    """Bad input to a variant: an unknown name, a wrong shape, a parameter out of range."""


class UnsupportedBackend(VariantError):
    """A known backend that this variant (or this configuration of it) has no implementation for."""
