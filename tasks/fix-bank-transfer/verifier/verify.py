"""Hidden verifier for fix-bank-transfer: random operation scripts against an integer-cent reference."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import bank
out = []
for ops in payload:
    b = bank.Bank()
    trace = []
    for op in ops:
        try:
            r = getattr(b, op[0])(*op[1:])
            trace.append(["ok", [list(x) for x in r] if op[0] == "history" else r])
        except bank.InsufficientFunds:
            trace.append(["err", "InsufficientFunds"])
        except bank.UnknownAccount:
            trace.append(["err", "UnknownAccount"])
        except bank.BankError:
            trace.append(["err", "BankError"])
        except Exception as e:
            trace.append(["err", "other " + type(e).__name__])
    out.append(trace)
emit(out)
'''


def is_amount(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def ref(ops):
    bal, hist, trace = {}, {}, []

    def ok(r=None):
        trace.append(["ok", r])

    def err(kind):
        trace.append(["err", kind])

    for op in ops:
        name, args = op[0], op[1:]
        if name == "open":
            who, cents = args[0], args[1] if len(args) > 1 else 0
            if who in bal:
                err("BankError")
            elif not is_amount(cents):
                err("BankError")
            else:
                bal[who], hist[who] = cents, []
                ok()
        elif name in ("deposit", "withdraw"):
            who, cents = args
            if who not in bal:
                err("UnknownAccount")
            elif not is_amount(cents) or cents == 0:
                err("BankError")
            elif name == "withdraw" and cents > bal[who]:
                err("InsufficientFunds")
            else:
                bal[who] += cents if name == "deposit" else -cents
                hist[who].append([name, cents, bal[who]])
                ok()
        elif name == "transfer":
            src, dst, cents = args
            if src not in bal or dst not in bal:
                err("UnknownAccount")
            elif not is_amount(cents) or cents == 0 or src == dst:
                err("BankError")
            elif cents > bal[src]:
                err("InsufficientFunds")
            else:
                bal[src] -= cents
                bal[dst] += cents
                hist[src].append(["transfer-out", cents, bal[src]])
                hist[dst].append(["transfer-in", cents, bal[dst]])
                ok()
        elif name == "apply_interest":
            bp = args[0]
            if not is_amount(bp):
                err("BankError")
                continue
            for who in sorted(bal):
                gain = bal[who] * bp // 10000
                if gain > 0:
                    bal[who] += gain
                    hist[who].append(["interest", gain, bal[who]])
            ok()
        elif name == "balance":
            err("UnknownAccount") if args[0] not in bal else ok(bal[args[0]])
        else:
            err("UnknownAccount") if args[0] not in bal else ok([list(h) for h in hist[args[0]]])
    return trace


def check(ctx):
    rng = random.Random(1234)
    names = ["ann", "bob", "cy", "dee"]
    scripts = []
    for _ in range(15):
        ops = [["open", "ann", rng.choice([0, 100, 12345, 99999999])], ["open", "bob"]]
        for _ in range(50):
            r = rng.random()
            amt = rng.choice([0, 1, 7, 33, 100, 1001, 250000, -5, 2.5, True])
            if r < 0.08:
                ops.append(["open", rng.choice(names), rng.choice([0, 50, -1])])
            elif r < 0.28:
                ops.append(["deposit", rng.choice(names), amt])
            elif r < 0.45:
                ops.append(["withdraw", rng.choice(names), amt])
            elif r < 0.7:
                ops.append(["transfer", rng.choice(names), rng.choice(names), amt])
            elif r < 0.78:
                ops.append(["apply_interest", rng.choice([0, 1, 150, 333, 10000, -10])])
            elif r < 0.9:
                ops.append(["balance", rng.choice(names)])
            else:
                ops.append(["history", rng.choice(names)])
        scripts.append(ops)
    got = ctx.results(DRIVER, ctx.fresh(), scripts)
    for i, (ops, g) in enumerate(zip(scripts, got)):
        want = ref(ops)
        if g != want:
            k = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), 0)
            raise vharness.Fail("script %d step %d %r: got %r, want %r" % (i, k, ops[k], str(g[k])[:150], str(want[k])[:150]))
    return 1.0, "%d random scripts correct" % len(scripts)


if __name__ == "__main__":
    vharness.main(check, __file__)
