"""Visible checks for deps.order (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deps  # noqa: E402

fails = []
try:
    got = deps.order(deps.parse("app: lib util\nlib: util\ntest: app\n"))
    if got != ["util", "lib", "app", "test"]:
        fails.append("order: %r" % got)
    got = deps.order({"b": [], "a": [], "c": ["b"]})
    if got != ["a", "b", "c"]:
        fails.append("smallest order: %r" % got)
except Exception as e:  # noqa: BLE001
    fails.append("raised %s: %s" % (type(e).__name__, e))
try:
    deps.order({"x": ["y"], "y": ["x"]})
    fails.append("a cycle did not raise CycleError")
except deps.CycleError as e:
    if e.cycle not in (["x", "y", "x"], ["y", "x", "y"]):
        fails.append("cycle %r" % e.cycle)
except Exception as e:  # noqa: BLE001
    fails.append("a cycle raised %s" % type(e).__name__)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
