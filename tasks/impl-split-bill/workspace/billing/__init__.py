"""Splitting amounts of integer cents: allocate() and the invoice built on it."""

from .allocate import allocate
from .invoice import split_invoice

__all__ = ["allocate", "split_invoice"]
