"""A store of items keyed by sku."""


class Store:
    def __init__(self):
        self.items = {}

    def add(self, item):
        self.items[item.sku] = item

    def remove(self, sku, qty):
        self.items[sku].qty -= qty

    def restock(self, sku, qty):
        self.items[sku].qty += qty

    def total_value(self):
        return sum(item.price_cents for item in self.items.values())

    def low_stock(self, threshold):
        return [sku for sku, item in self.items.items() if item.qty <= threshold]

    def find(self, text):
        return [sku for sku, item in self.items.items() if text in item.name]
