"""A tiny arithmetic evaluator: evaluate("1 + 2*3") == 7."""

from .errors import CalcError
from .evaluate import evaluate

__all__ = ["CalcError", "evaluate"]
