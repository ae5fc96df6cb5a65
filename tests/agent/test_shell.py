"""The shell parser: exact enumerations of the simple commands a line runs, quote removal as POSIX
sh does it (checked against the real /bin/sh where it matters), and fail-closed refusals."""

import subprocess

import pytest

from k3.agent.shell import ShellParseError, parse_shell


def cmds(line):
    return [(c.origin, c.argv) for c in parse_shell(line)]


def test_lists_pipelines_and_substitutions_are_enumerated_in_order():
    assert cmds("a 1 | b 2 && c; d & e || f") == [("line", ["a", "1"]), ("line", ["b", "2"]), ("line", ["c"]),
                                                  ("line", ["d"]), ("line", ["e"]), ("line", ["f"])]
    assert cmds("echo $(ls -l | wc -l) `date`") == [("line", ["echo", "$(ls -l | wc -l)", "`date`"]),
                                                   ("$(...)", ["ls", "-l"]), ("$(...)", ["wc", "-l"]),
                                                   ("`...`", ["date"])]
    assert cmds('echo "x $(id -u) y"') == [("line", ["echo", "x $(id -u) y"]), ("$(...)", ["id", "-u"])]
    assert cmds("diff <(sort a) >(tee b)") == [("line", ["diff", "/dev/fd/63", "/dev/fd/63"]),
                                               ("<(...)", ["sort", "a"]), (">(...)", ["tee", "b"])]
    assert cmds("if test -f x; then rm x; else touch x; fi") == [("line", ["test", "-f", "x"]),
                                                                 ("line", ["rm", "x"]), ("line", ["touch", "x"])]
    assert cmds("for f in *.py; do wc -l $f; done") == [("line", ["wc", "-l", "$f"])]
    assert cmds("echo $(echo $(echo deep))")[-1] == ("$(...)", ["echo", "deep"])


def test_redirections_assignments_and_fds():
    (c,) = parse_shell("X=1 Y=2 cmd a 2>&1 >> out.log < in.txt")
    assert c.assignments == ["X=1", "Y=2"] and c.argv == ["cmd", "a"]
    assert [(r.fd, r.op, r.target.text) for r in c.redirects] == [("2", ">&", "1"), ("", ">>", "out.log"),
                                                                  ("", "<", "in.txt")]


def test_heredoc_bodies_are_data_unless_the_delimiter_is_unquoted():
    assert cmds("cat <<'EOF' > f\nrm -rf /\n$(reboot)\nEOF\nls") == [("line", ["cat"]), ("line", ["ls"])]
    assert cmds("cat <<EOF\nhi $(whoami)\nEOF") == [("line", ["cat"]), ("heredoc $(...)", ["whoami"])]


@pytest.mark.parametrize("word", ["'a b'\"c\"d", "a\\ b", "\"a\\\"b\"", "'$x'", "\"\\$x\"", "a''b", "\"it's\""])
def test_quote_removal_matches_sh(word):
    real = subprocess.run(["/bin/sh", "-c", f"printf '%s\\n' {word}"], capture_output=True, text=True).stdout
    (c,) = parse_shell(f"printf '%s\\n' {word}")
    assert c.argv[2:] == real.splitlines()


def test_expansions_and_globs_are_marked():
    (c,) = parse_shell("rm $X ${Y} '$Z' *.py '*.txt' ~/a")
    assert [(w.dynamic, w.glob) for w in c.words[1:]] == [(True, False), (True, False), (False, False),
                                                          (False, True), (False, False), (False, False)]


@pytest.mark.parametrize("line,fixed", [("echo 'x", "echo 'x'"), ('echo "x', 'echo "x"'), ("echo $(x", "echo $(x)"),
                                       ("echo `x", "echo `x`"), ("case a in a) x;; esac", "test a = a && x"),
                                       ("f() { x; }", "{ x; }"), ("echo $(( $(id) ))", "echo $(( 1 + 2 ))"),
                                       ("cat <<E\nx", "cat <<E\nx\nE"), ("a \\", "a \\\\")])
def test_unreadable_lines_raise(line, fixed):
    with pytest.raises(ShellParseError):
        parse_shell(line)
    assert parse_shell(fixed)


def test_nesting_is_bounded():
    deep = "echo " + "$(echo " * 10 + "x" + ")" * 10
    with pytest.raises(ShellParseError, match="nesting"):
        parse_shell(deep)
    parse_shell("echo " + "$(echo " * 5 + "x" + ")" * 5)
