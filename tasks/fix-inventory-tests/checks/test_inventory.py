"""Visible unit tests of inventory (stdlib unittest)."""
import unittest

from inventory import Item, Store, format_cents, report


def store():
    s = Store()
    s.add(Item("BOLT-M6", "Bolt M6", 100, 12))
    s.add(Item("NUT-M6", "Nut m6", 3, 5))
    s.add(Item("WASHER", "Washer", 10, 2))
    return s


class StoreTest(unittest.TestCase):
    def test_total_value(self):
        self.assertEqual(store().total_value(), 100 * 12 + 3 * 5 + 10 * 2)

    def test_remove_too_many_refused(self):
        s = store()
        with self.assertRaises(ValueError):
            s.remove("NUT-M6", 4)
        self.assertEqual(s.items["NUT-M6"].qty, 3)

    def test_duplicate_sku_refused(self):
        s = store()
        with self.assertRaises(ValueError):
            s.add(Item("WASHER", "Other", 1, 1))

    def test_low_stock_is_strictly_below(self):
        self.assertEqual(store().low_stock(10), ["NUT-M6"])

    def test_find_ignores_case(self):
        self.assertEqual(store().find("M6"), ["BOLT-M6", "NUT-M6"])

    def test_format_cents(self):
        self.assertEqual(format_cents(5), "$0.05")
        self.assertEqual(format_cents(123456), "$1,234.56")

    def test_report_last_line(self):
        self.assertEqual(report(store()).splitlines()[-1], "total $12.35")


if __name__ == "__main__":
    unittest.main()
