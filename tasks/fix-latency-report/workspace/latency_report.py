"""python3 latency_report.py IN.jsonl OUT.json: per-endpoint latency and error summary of a request log."""

import json
import sys


def percentile(values, p):
    values = sorted(values)
    return values[int(len(values) * p / 100)]


def main(argv):
    src, dst = argv
    per = {}
    for line in open(src):
        rec = json.loads(line)
        per.setdefault(rec["path"], []).append(rec)
    out = {}
    for path, recs in per.items():
        ms = [r["ms"] for r in recs]
        errors = len([r for r in recs if r["status"] > 500])
        out[path] = {"count": len(recs), "p50": percentile(ms, 50), "p95": percentile(ms, 95),
                     "error_rate": errors // len(recs)}
    json.dump(out, open(dst, "w"), indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
