"""k3.agent.tools over a real namespace sandbox (here, beside the sandbox fixtures): each tool's
result, its errors as results (never exceptions), the output cap, timeouts; and the policy's
allowed twins of denied lines really run and do what they say."""

from k3.agent.policy import Policy, PolicyContext
from k3.agent.tools import ToolBox


def test_each_tool_over_a_sandbox(sandboxes):
    with sandboxes.create() as sb:
        box = ToolBox(sb, max_output=2000)
        r = box.run("write", {"path": "deep/er/a.txt", "content": "one two two\n"})
        assert not r.error and r.output == "wrote 12 bytes to deep/er/a.txt"
        assert box.run("read", {"path": "deep/er/a.txt"}).output == "one two two\n"
        assert box.run("edit", {"path": "deep/er/a.txt", "old": "one", "new": "1"}).output == "edited deep/er/a.txt"
        twice = box.run("edit", {"path": "deep/er/a.txt", "old": "two", "new": "2"})
        assert twice.error and "occurs 2 times" in twice.output and twice.meta["occurrences"] == 2
        assert box.run("read", {"path": "deep/er/a.txt"}).output == "1 two two\n"
        assert box.run("list", {"path": "deep/er"}).output == "a.txt (10 bytes)"
        assert box.run("list", {}).output == "deep/"
        sh = box.run("shell", {"command": "echo out; echo err >&2; exit 3"})
        assert sh.error and sh.output == "exit code 3\nout\n\n[stderr]\nerr\n" and sh.meta["exit_code"] == 3
        assert box.run("shell", {"command": "cat deep/er/a.txt"}).output == "exit code 0\n1 two two\n"
        slow = box.run("shell", {"command": "sleep 10", "timeout": 0.5})
        assert slow.error and slow.meta["timed_out"] and slow.output.startswith("timed out")
        big = box.run("shell", {"command": "seq 1 100000"})
        assert big.meta["truncated"] and len(big.output) < 2100 and "characters cut" in big.output
        assert big.output.rstrip().endswith("100000") and big.output.startswith("exit code 0\n1\n2\n")
        missing = box.run("read", {"path": "nope.txt"})
        assert missing.error and "nope.txt" in missing.output
        bad = box.run("write", {"path": "x"})
        assert bad.error and "missing argument 'content'" in bad.output


def test_allowed_twins_of_denied_lines_really_run(sandboxes):
    p = Policy()
    with sandboxes.create() as sb:
        box = ToolBox(sb)
        box.run("shell", {"command": "mkdir -p build/x src && touch build/x/f src/keep"})
        for line in ("echo hi | rm -rf build", "bash -c 'rm -rf src/keep'"):
            d = p.decide("shell", {"command": line}, "c", PolicyContext(steps_left=3))
            assert d.allowed
            assert not box.run("shell", {"command": line}).error
        assert box.run("list", {}).output == "src/"
        d = p.decide("shell", {"command": "bash -c 'rm -rf /'"}, "c", PolicyContext(steps_left=3))
        assert not d.allowed
