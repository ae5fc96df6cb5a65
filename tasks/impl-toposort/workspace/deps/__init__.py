"""Build-order resolution: deps.order(graph) and the text format of deps.parse."""

from .errors import CycleError
from .graph import order
from .parse import parse

__all__ = ["CycleError", "order", "parse"]
