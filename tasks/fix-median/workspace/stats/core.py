"""Central tendency."""

from collections import Counter


def mean(data):
    return sum(data) / len(data)


def median(data):
    n = len(data)
    return data[n // 2]


def mode(data):
    counts = Counter(data)
    return counts.most_common(1)[0][0]
