"""Hidden verifier for mktree-manifest: other manifests, existing content kept, re-runs, refusals."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402


def tree(root):
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        out += [os.path.normpath(os.path.join(rel, x)) + "/" for x in dirs]
        out += [os.path.normpath(os.path.join(rel, x)) for x in files]
    return sorted(out)


GOOD = [
    ("a/\na/b/\na/b/c.txt\n", ["a/", "a/b/", "a/b/c.txt"]),
    ("# c\n\nx y/z w.txt\nx y/\n-n/-e\n#not/\nlast/file", ["-n/", "-n/-e", "last/", "last/file", "x y/", "x y/z w.txt"]),
    ("deep/er/still/deeper/f\ndeep/g/\n", ["deep/", "deep/er/", "deep/er/still/", "deep/er/still/deeper/",
                                          "deep/er/still/deeper/f", "deep/g/"]),
    ("keep.txt\nsub/keep2.txt\n", ["keep.txt", "sub/", "sub/keep2.txt"]),
    ("", []),
]
BAD = ["ok/\n/abs/path\n", "fine\n..\n", "a/b/../../c\n", "x/\nsub/..\n", "../x/\n"]


def check(ctx):
    for i, (manifest, want) in enumerate(GOOD):
        pre = {"out/keep.txt": "old content\n"} if i == 3 else {}
        ws = ctx.fresh(dict({"m.manifest": manifest}, **pre))
        for run in (1, 2):
            res = ctx.run(["/bin/sh", "mktree.sh", "m.manifest", "out"], ws)
            if res.returncode != 0:
                raise vharness.Fail("manifest %d run %d: exit %d: %s" % (i, run, res.returncode, res.stderr[-200:]))
            got = tree(os.path.join(ws, "out")) if os.path.isdir(os.path.join(ws, "out")) else None
            if got != want:
                raise vharness.Fail("manifest %d run %d: tree %r, want %r" % (i, run, got, want))
        if i == 3:
            with open(os.path.join(ws, "out", "keep.txt")) as f:
                if f.read() != "old content\n":
                    raise vharness.Fail("an existing file was truncated")
        for name in want:
            if not name.endswith("/") and i != 3 and os.path.getsize(os.path.join(ws, "out", name)) != 0:
                raise vharness.Fail("%s is not empty" % name)
    for j, manifest in enumerate(BAD):
        ws = ctx.fresh({"m.manifest": manifest})
        res = ctx.run(["/bin/sh", "mktree.sh", "m.manifest", "out/root"], ws)
        if res.returncode != 2:
            raise vharness.Fail("bad manifest %d: exit %d, want 2" % (j, res.returncode))
        if os.path.exists(os.path.join(ws, "out")) or os.path.exists(os.path.join(ws, "x")):
            raise vharness.Fail("bad manifest %d created files" % j)
    return 1.0, "%d manifests built and %d refused correctly" % (len(GOOD), len(BAD))


if __name__ == "__main__":
    vharness.main(check, __file__)
