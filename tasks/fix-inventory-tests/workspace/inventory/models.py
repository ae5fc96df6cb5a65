"""Stock items. Money is integer cents."""

import re
from dataclasses import dataclass

SKU = re.compile(r"[A-Z0-9]+(-[A-Z0-9]+)*")


@dataclass
class Item:
    sku: str
    name: str
    qty: int
    price_cents: int

    def __post_init__(self):
        if not isinstance(self.sku, str) or not SKU.fullmatch(self.sku):
            raise ValueError("bad sku %r" % (self.sku,))
        for field in ("qty", "price_cents"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError("%s must be an int >= 0, got %r" % (field, value))
