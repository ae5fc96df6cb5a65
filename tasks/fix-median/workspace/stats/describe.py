"""One-call summary of a sample."""

from .core import mean, median, mode


def describe(data):
    return {
        "count": len(data),
        "mean": mean(data),
        "median": median(data),
        "mode": mode(data),
        "min": min(data),
        "max": max(data),
    }
