"""The policy chain (SPEC §7.4): each refusal beside an allowed command of the same shape.

What is caught as network use: curl, wget, nc/ncat/netcat, ssh/scp, telnet, socat, rsync to a host,
/dev/tcp redirections, git clone/fetch/pull, and python -c / perl -e / node -e code naming a socket
or HTTP module. A program that opens a socket by itself (a script file) is left to the sandbox's
empty network namespace (tests/rl/test_cleanroom.py runs commands in real sandboxes).
"""

import pytest

from k3.agent.policy import ApprovalRequest, Policy, PolicyContext
from k3.errors import ConfigError


def decide(cmd, policy=None, tool="shell", **ctx):
    policy = policy or Policy()
    args = {"command": cmd} if tool == "shell" else cmd
    return policy.decide(tool, args, "call_0", PolicyContext(**{"steps_left": 5, **ctx}))


# (denied line, allowed line of the same shape)
RM_ROOT = [
    ("rm -rf /", "rm -rf build"),
    ("echo hi | rm -rf /", "echo hi | rm -rf build"),
    ("cat x | grep y | rm -rf / 2>/dev/null", "cat x | grep y | rm -rf out 2>/dev/null"),
    ("echo $(rm -rf /)", "echo $(rm -rf build)"),
    ('echo "$(rm -rf /usr)"', 'echo "$(rm -rf ./tmpdir)"'),
    ("echo `rm -rf /`", "echo `rm -rf build`"),
    ("ls; rm -rf /", "ls; rm -rf build"),
    ("true && rm -rf /", "true && rm -rf build"),
    ("false || rm -rf /*", "false || rm -rf build/*"),
    ("bash -c 'rm -rf /'", "bash -c 'rm -rf build'"),
    ("sh -c \"ls && rm -rf /etc\"", "sh -c \"ls && rm -rf etc\""),
    ("bash -c \"bash -c 'rm -rf /'\"", "bash -c \"bash -c 'rm -rf build'\""),
    ("eval rm -rf /", "eval rm -rf build"),
    ("(cd /; rm -rf *)", "(cd src; rm -rf *)"),
    ("cd .. && cd .. && rm -rf bin", "cd src && cd .. && rm -rf bin"),
    ("find / -name '*.py' -exec rm {} \\;", "find . -name '*.py' -exec rm {} \\;"),
    ("find /usr -delete", "find build -delete"),
    ("env X=1 nohup timeout 5 rm -rf /", "env X=1 nohup timeout 5 rm -rf build"),
    ("diff <(rm -rf /) a", "diff <(ls) a"),
    ("python3 -c 'import os; os.system(\"rm -rf /\")'", "python3 -c 'import os; os.system(\"rm -rf b\")'"),
    ("cat <<EOF\n$(rm -rf /)\nEOF", "cat <<'EOF'\n$(rm -rf /)\nEOF"),
]


@pytest.mark.parametrize("bad,good", RM_ROOT)
def test_rm_root_hidden_in_a_line_is_denied_and_the_same_shape_inside_the_workspace_is_allowed(bad, good):
    d = decide(bad)
    assert d.action == "deny" and not d.allowed, (bad, d)
    assert d.rule == "path-rules" and "outside the workspace" in d.reason
    ok = decide(good)
    assert ok.action == "allow" and ok.allowed, (good, ok)


@pytest.mark.parametrize("bad,good", [
    ("git push origin main", "git commit -m 'x'"),
    ("git -C repo push --force", "git -C repo status"),
    ("cd repo && git push", "cd repo && git log"),
    ("bash -c 'git push'", "bash -c 'git diff'"),
])
def test_git_push_is_denied_other_git_is_allowed(bad, good):
    d = decide(bad)
    assert (d.action, d.rule) == ("deny", "risk-class") and d.reason.startswith("vcs_push")
    assert decide(good).allowed


NETWORK = [
    ("curl https://example.com", "cat https.txt"),
    ("wget -q http://example.com/x", "echo http://example.com/x"),
    ("nc -l 8080", "wc -l 8080"),
    ("ncat 10.0.0.1 80 < req", "cat req"),
    ("ssh user@host ls", "ls"),
    ("scp a host:b", "cp a b"),
    ("echo hi > /dev/tcp/10.0.0.1/80", "echo hi > tcp.txt"),
    ("rsync -a src host:/dst", "rsync -a src dst"),
    ("git clone https://github.com/x/y", "git init y"),
    ("python3 -c 'import socket; socket.create_connection((\"h\", 80))'", "python3 -c 'import json; print(1)'"),
    ("python3 -c 'import urllib.request as u; u.urlopen(\"http://h\")'", "python3 -c 'import os; print(os.sep)'"),
    ("python3 -m http.server 8000", "python3 -m json.tool data.json"),
    ("node -e \"require('http').get('http://h')\"", "node -e \"console.log(1)\""),
    ("ls | xargs curl", "ls | xargs wc -l"),
]


@pytest.mark.parametrize("bad,good", NETWORK)
def test_network_use_is_denied_and_the_local_twin_is_allowed(bad, good):
    d = decide(bad)
    assert d.action == "deny" and d.reason.startswith("network"), (bad, d)
    assert decide(good).allowed, good


def test_network_is_allowed_when_the_policy_allows_it():
    assert decide("curl https://example.com", Policy(network=True)).allowed


WRITES = [
    ("echo x > /etc/passwd", "echo x > passwd"),
    ("echo x >> ~/.bashrc", "echo x >> .bashrc"),
    ("cp evil /usr/bin/python3", "cp evil bin/python3"),
    ("mv a ../../outside", "mv a inside"),
    ("tee /etc/hosts < x", "tee hosts < x"),
    ("sed -i s/a/b/ /etc/profile", "sed -i s/a/b/ profile"),
    ("touch /verifier/verify.py", "touch checks/verify.py"),
    ("dd if=/dev/zero of=/dev/sda", "dd if=/dev/zero of=disk.img"),
    ("ln -s x /usr/local/bin/python3", "ln -s x bin/python3"),
    ("chmod 777 /etc/shadow", "chmod 755 run.sh"),
]


@pytest.mark.parametrize("bad,good", WRITES)
def test_writes_outside_the_workspace_are_denied(bad, good):
    d = decide(bad)
    assert d.action == "deny" and d.rule == "path-rules", (bad, d)
    assert decide(good).allowed, good


@pytest.mark.parametrize("tool,bad,good", [
    ("write", {"path": "../outside.txt", "content": "x"}, {"path": "inside.txt", "content": "x"}),
    ("write", {"path": "/usr/bin/python3", "content": "x"}, {"path": "/workspace/bin/python3", "content": "x"}),
    ("edit", {"path": "../../etc/passwd", "old": "a", "new": "b"}, {"path": "src/a.py", "old": "a", "new": "b"}),
    ("write", {"path": "a/../../x", "content": ""}, {"path": "a/../x", "content": ""}),
])
def test_file_tools_outside_the_workspace_are_denied(tool, bad, good):
    assert decide(bad, tool=tool).action == "deny"
    assert decide(good, tool=tool).allowed


PACKAGES = [
    ("pip install numpy", "pip list"),
    ("pip3 install -r requirements.txt", "pip3 --version"),
    ("python3 -m pip install requests", "python3 -m pytest -q"),
    ("apt-get install -y vim", "apt-cache policy vim"),
    ("apt install curl", "apt list --installed"),
    ("npm install left-pad", "npm test"),
    ("npm i", "npm run build"),
    ("yarn add react", "yarn test"),
    ("dpkg -i x.deb", "dpkg -l"),
    ("cargo install ripgrep", "cargo build"),
    ("bash -c 'pip install x'", "bash -c 'pip show x'"),
]


@pytest.mark.parametrize("bad,good", PACKAGES)
def test_package_installs_ask_and_without_an_approver_are_denied(bad, good):
    d = decide(bad)
    assert d.action == "ask" and not d.allowed and d.approval == "no approver", (bad, d)
    assert d.reason.startswith("package_install")
    g = decide(good)
    assert g.action == "allow" and g.allowed, good


def test_ask_goes_to_the_approval_callback_with_the_call():
    seen: list[ApprovalRequest] = []

    def approve(req):
        seen.append(req)
        return req.arguments["command"].endswith("numpy")

    p = Policy(approve)
    assert decide("pip install numpy", p).approval == "approved"
    d = decide("pip install torch", p)
    assert (d.allowed, d.approval) == (False, "denied")
    assert [r.tool for r in seen] == ["shell", "shell"] and seen[0].call_id == "call_0"
    assert decide("rm -rf /", p).action == "deny" and len(seen) == 2  # a deny never asks


def test_yolo_approves_asks_but_not_denies_and_is_refused_outside_a_sandbox():
    p = Policy(yolo=True, sandboxed=True)
    d = decide("pip install numpy", p)
    assert (d.action, d.allowed, d.approval) == ("ask", True, "yolo")
    assert not decide("rm -rf /", p).allowed
    with pytest.raises(ConfigError, match="yolo"):
        Policy(yolo=True, sandboxed=False)
    assert Policy(yolo=False, sandboxed=False).decide  # without yolo a local policy is fine


@pytest.mark.parametrize("line,literal", [("$CMD -rf build", "rm -rf build"), ("x=rm; $x -rf b", "x=rm; rm -rf b"),
                                          ("eval \"$SCRIPT\"", "eval \"ls -l\""), ("bash -c \"$S\"", "bash -c \"ls\""),
                                          ("echo b | xargs rm -rf", "echo b | xargs wc -l"),
                                          ("rm -rf \"$DIR\"", "rm -rf \"dir\"")])
def test_commands_known_only_at_run_time_ask(line, literal):
    d = decide(line)
    assert d.action == "ask" and not d.allowed, (line, d)
    assert decide(literal).allowed, literal


@pytest.mark.parametrize("line", ["echo 'unterminated", "echo $(ls", "case $x in a) ls;; esac", "f() { ls; }",
                                  "echo ${x:-$(rm -rf /)}", "cat <<EOF\nno end"])
def test_unparseable_lines_are_denied(line):
    d = decide(line)
    assert (d.action, d.rule) == ("deny", "parsed-command"), (line, d)
    assert decide("echo 'terminated'").allowed


def test_budget_comes_first():
    p = Policy()
    assert decide("ls", p, steps_left=0).rule == "budget"
    d = p.decide("submit", {}, "c", PolicyContext(steps_left=3, submissions_left=0))
    assert (d.action, d.rule, d.reason) == ("deny", "budget", "submission budget exhausted")
    assert p.decide("submit", {}, "c", PolicyContext(steps_left=3, submissions_left=1)).allowed
    d = p.decide("shell", {"command": "ls"}, "c", PolicyContext(steps_left=3, allowed_tools=("read",)))
    assert d.rule == "budget" and "not allowed" in d.reason


def test_process_control_asks_and_privilege_is_denied():
    assert decide("kill 1").action == "ask"
    assert decide("sudo ls").action == "deny"
    assert decide("mount -t tmpfs x /mnt").action == "deny"
    assert decide("ps aux").allowed


def test_a_rule_that_raises_denies(monkeypatch):
    p = Policy()

    def broken(tool, args, ctx):
        raise RuntimeError("boom")

    assert decide("ls", p).allowed
    monkeypatch.setattr(p.rules[2], "check", broken)
    d = decide("ls", p)
    assert (d.action, d.rule) == ("deny", "path-rules") and "boom" in d.reason


def test_every_decision_is_logged_with_its_effects():
    p = Policy()
    for line in ("ls", "rm -rf /", "pip install x"):
        decide(line, p)
    assert [d.action for d in p.log] == ["allow", "deny", "ask"]
    rec = p.log[1].as_dict()
    assert rec["effects"][0] == {"risk": "delete", "path": "/", "dynamic": False, "detail": "rm -rf /"}
