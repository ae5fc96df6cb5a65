"""Hidden verifier for fix-rotate-logs: other directories (mtimes contradicting names, decoys, edge KEEPs)."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DECOYS = ["app-old.log", "app-2026010.log", "app-202601011.log", "other-20260101.log", "app-20260101.log.bak",
          "app-2026O101.log"]


def scenario(rng, n):
    dates = sorted(rng.sample(range(20240101, 20261231), n))
    names = ["app-%d.log" % d for d in dates]
    return names, rng.sample(DECOYS, rng.randint(0, len(DECOYS)))


def run_case(ctx, names, decoys, keep, subdir="logs dir", want_rc=0):
    files = {os.path.join(subdir, n): "x\n" for n in names + decoys}
    ws = ctx.fresh(files)
    d = os.path.join(ws, subdir)
    for i, n in enumerate(names):  # newest name = oldest mtime, so mtime order is wrong
        os.utime(os.path.join(d, n), (1_000_000_000 + (len(names) - i) * 3600,) * 2)
    if names:
        os.mkdir(os.path.join(d, "app-20000101.log"))
        if ctx.drop:
            os.chown(os.path.join(d, "app-20000101.log"), vharness.NOBODY, vharness.NOBODY)
    res = ctx.run(["/bin/sh", "rotate.sh", subdir, keep], ws)
    if res.returncode != want_rc:
        raise vharness.Fail("rotate.sh %r %r: exit %d, want %d (%s)" % (subdir, keep, res.returncode, want_rc,
                                                                        res.stderr.strip()[-200:]))
    if want_rc:
        drop = []
    else:
        drop = names[: max(0, len(names) - int(keep))]
    want_out = "".join(n + "\n" for n in drop)
    if res.stdout != want_out:
        raise vharness.Fail("rotate.sh %r %s printed %r, want %r" % (subdir, keep, res.stdout[:200], want_out[:200]))
    left = sorted(os.listdir(d))
    want_left = sorted(set(names + decoys + (["app-20000101.log"] if names else [])) - set(drop))
    if left != want_left:
        raise vharness.Fail("rotate.sh %s left %r, want %r" % (keep, left, want_left))


def check(ctx):
    rng = random.Random(2718)
    n_cases = 0
    for n, keep in [(6, "3"), (9, "1"), (5, "0"), (3, "3"), (2, "10"), (12, "5"), (0, "2")]:
        names, decoys = scenario(rng, n)
        run_case(ctx, names, decoys, keep)
        n_cases += 1
    names, decoys = scenario(rng, 4)
    for bad in ("-1", "x", "", "2a"):
        run_case(ctx, names, decoys, bad, want_rc=2)
    res = ctx.run(["/bin/sh", "rotate.sh", "no such dir", "1"], ctx.fresh())
    if res.returncode != 2:
        raise vharness.Fail("a missing DIR gave exit %d, want 2" % res.returncode)
    return 1.0, "%d rotations and 5 refusals correct" % n_cases


if __name__ == "__main__":
    vharness.main(check, __file__)
