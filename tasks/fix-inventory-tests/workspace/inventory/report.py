"""Text output."""


def format_cents(cents):
    return "$%d.%d" % (cents // 100, cents % 100)


def report(store):
    lines = []
    for sku in sorted(store.items):
        item = store.items[sku]
        lines.append("%s %s x%d @ %s" % (sku, item.name, item.qty, format_cents(item.price_cents)))
    lines.append("total " + format_cents(store.total_value()))
    return "\n".join(lines) + "\n"
