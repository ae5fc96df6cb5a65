"""Interval arithmetic on (start, end) pairs of numbers, half-open [start, end)."""


def merge(intervals):
    out = []
    for start, end in intervals:
        if start > end:
            raise ValueError("interval ends before it starts: (%r, %r)" % (start, end))
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def total(intervals):
    return sum(end - start for start, end in merge(intervals))


def free(intervals, lo, hi):
    gaps = []
    cursor = lo
    for start, end in merge(intervals):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = end
    if cursor < hi:
        gaps.append((cursor, hi))
    return gaps
