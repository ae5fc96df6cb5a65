"""Plain-text formatting: wrap() and the fill command built on it."""

from .wrap import wrap

__all__ = ["wrap"]
