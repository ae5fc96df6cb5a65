# grades report: python3 grades.py FILE.csv   (columns: student,course,score)
import csv
import sys

f = open(sys.argv[1], newline="")
rows = []
bad = 0
for r in csv.reader(f):
    if r == ["student", "course", "score"] or not r:
        continue
    if len(r) != 3:
        bad = bad + 1
        continue
    try:
        s = float(r[2])
    except ValueError:
        bad = bad + 1
        continue
    if s < 0 or s > 100:
        bad = bad + 1
        continue
    rows.append((r[0].strip(), r[1].strip(), s))
f.close()
totals = {}
counts = {}
for st, co, sc in rows:
    totals[st] = totals.get(st, 0) + sc
    counts[st] = counts.get(st, 0) + 1
avgs = {}
for st in totals:
    avgs[st] = totals[st] / counts[st]
ranked = sorted(avgs, key=lambda st: (-avgs[st], st))
print("%-12s %6s %s" % ("student", "avg", "grade"))
for st in ranked:
    a = avgs[st]
    if a >= 90:
        g = "A"
    elif a >= 80:
        g = "B"
    elif a >= 70:
        g = "C"
    elif a >= 60:
        g = "D"
    else:
        g = "F"
    print("%-12s %6.1f %s" % (st, a, g))
courses = {}
for st, co, sc in rows:
    courses.setdefault(co, []).append(sc)
for co in sorted(courses):
    xs = courses[co]
    print("course %s: n=%d mean=%.2f max=%.1f" % (co, len(xs), sum(xs) / len(xs), max(xs)))
if rows:
    print("class mean %.2f" % (sum(sc for _, _, sc in rows) / len(rows)))
if bad:
    print("skipped %d bad rows" % bad)
