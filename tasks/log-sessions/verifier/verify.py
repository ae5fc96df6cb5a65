"""Hidden verifier for log-sessions: sessions.tsv, and sessions.py on generated logs."""
import os
import random
import sys
from datetime import datetime, timedelta, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_auth.log")) as _f:
    VISIBLE = _f.read()


def parse_ts(text):
    try:
        if not text.endswith("Z") or len(text) != 20:
            return None
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def ref(text):
    events = []
    for i, line in enumerate(text.splitlines()):
        parts = line.split()
        if len(parts) != 3 or parts[1] not in ("login", "logout"):
            continue
        ts = parse_ts(parts[0])
        if ts is None:
            continue
        events.append((ts, i, parts[1], parts[2]))
    events.sort()
    open_, stats = {}, {}
    for ts, _i, ev, user in events:
        if ev == "login" and user not in open_:
            open_[user] = ts
        elif ev == "logout" and user in open_:
            n, s = stats.get(user, (0, 0))
            stats[user] = (n + 1, s + int((ts - open_.pop(user)).total_seconds()))
    if events:
        end = events[-1][0]
        for user, start in open_.items():
            n, s = stats.get(user, (0, 0))
            stats[user] = (n + 1, s + int((end - start).total_seconds()))
    rows = sorted(stats.items(), key=lambda kv: (-kv[1][1], kv[0]))
    return "user\tsessions\tseconds\n" + "".join("%s\t%d\t%d\n" % (u, n, s) for u, (n, s) in rows)


def gen(rng, n):
    base = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)
    users = ["u%d" % i for i in range(rng.randint(1, 6))] + ["zoë", "a-b"]
    lines = []
    for _ in range(n):
        ts = base + timedelta(seconds=rng.randint(0, 3 * 86400))
        r = rng.random()
        if r < 0.06:
            lines.append(rng.choice(["", "junk", "2026-12-01 login x", "2026-12-01T10:00:00Z shutdown u1",
                                     "2026-13-01T10:00:00Z login u1", "2026-12-01T10:00:00Z login",
                                     "2026-12-01T10:00:00+01:00 login u1"]))
            continue
        lines.append("%s %s %s" % (ts.strftime("%Y-%m-%dT%H:%M:%SZ"), rng.choice(["login", "logout"]), rng.choice(users)))
    if rng.random() < 0.5:
        t = base.strftime("%Y-%m-%dT%H:%M:%SZ")
        lines += ["%s login same" % t, "%s logout same" % t]
    return "\n".join(lines) + "\n"


def check(ctx):
    ws = ctx.fresh()
    got = vharness.read_text(ws, "sessions.tsv")
    if got != ref(VISIBLE):
        raise vharness.Fail("sessions.tsv is wrong: %r" % got[:200])
    rng = random.Random(77)
    for n in (0, 3, 40, 800):
        text = gen(rng, n)
        ws = ctx.fresh({"hidden.log": text})
        res = ctx.python("import runpy, sys\nsys.argv = ['sessions.py', 'hidden.log', 'out.tsv']\n"
                         "runpy.run_path('sessions.py', run_name='__main__')", ws, timeout=20)
        try:
            got = vharness.read_text(ws, "out.tsv")
        except vharness.Fail:
            raise vharness.Fail("sessions.py wrote no out.tsv: %s" % res.stderr[-300:])
        if got != ref(text):
            raise vharness.Fail("sessions.py on a hidden %d-line log gave %r..., want %r..." % (n, got[:150], ref(text)[:150]))
    return 1.0, "sessions.tsv and 4 hidden logs correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
