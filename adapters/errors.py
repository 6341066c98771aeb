"""Errors raised for adapters that users supply."""


class AdapterError(ValueError):
    """An adapter folder, config or weight file is invalid; the message names the field or tensor."""
