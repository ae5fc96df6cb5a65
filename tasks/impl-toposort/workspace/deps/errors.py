"""Errors of deps."""


class CycleError(ValueError):
    """The graph has a cycle; ``self.cycle`` lists it (see graph.order)."""

    def __init__(self, cycle):
        super().__init__("dependency cycle: " + " -> ".join(cycle))
        self.cycle = list(cycle)
