"""A small stock-keeping library: Item, Store, format_cents, report."""

from .models import Item
from .report import format_cents, report
from .store import Store

__all__ = ["Item", "Store", "format_cents", "report"]
