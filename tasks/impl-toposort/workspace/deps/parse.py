"""Text format: one 'node: dep dep ...' per line; '#' comments and blank lines skipped."""


def parse(text):
    graph = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        node, _, rest = line.partition(":")
        graph.setdefault(node.strip(), []).extend(rest.split())
    return graph
