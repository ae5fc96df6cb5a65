"""The task format: a valid task loads with its transcripts; unknown keys and bad values are refused
naming the key; the submit globs select what a naive reference glob selects."""

import fnmatch

import pytest

from k3.errors import ConfigError
from k3.cli.task import task_main
from k3.tasks.format import find_tasks, load_task, load_transcript, validate_task
from k3.tasks.verify import glob_regex
from taskdirs import make_task, toml, write_transcript


def test_a_valid_task_loads_with_defaults_and_transcripts(tmp_path):
    d = make_task(tmp_path)
    t = validate_task(d)
    assert (t.id, t.kind, t.submit, t.scoring) == ("tiny-add", "python", ["*.py"], "best")
    assert (t.budget.steps, t.budget.submissions, t.verifier_timeout) == (20, 2, 30)
    assert t.solution.expect_reward == 1.0 and [h.expect_reward for h in t.hacks] == [0.0]
    before = t.digest()
    assert len(before) == 64 and before == load_task(d).digest()
    (d / "workspace" / "calc.py").write_text("changed")
    assert load_task(d).digest() != before


def test_omitted_tables_take_the_defaults(tmp_path):
    d = make_task(tmp_path)
    (d / "task.toml").write_text('id = "tiny-add"\nkind = "shell"\ngoal = "g"\nsubmit = ["out.txt"]\n')
    t = load_task(d)
    assert (t.budget.steps, t.budget.tokens, t.budget.wall_seconds, t.budget.submissions) == (40, 32000, 120, 3)
    assert (t.scoring, t.allowed_tools, t.verifier_timeout) == ("best", ["shell", "read", "write", "edit", "list",
                                                                        "submit"], 60)


@pytest.mark.parametrize("text,match", [
    ('colour = "red"\n', "unknown key 'colour'"),
    ("[budget]\nsteps = 3\nwall = 2\n", "unknown key budget.'wall'"),
    ("[scoring]\nuse = \"mean\"\n", "best' or 'last"),
    ("[tools]\nallowed = [\"shell\", \"browser\"]\n", "allowed"),
    ("[budget]\nsteps = 0\n", "steps must be an int >= 1"),
    ("[budget]\nsubmissions = true\n", "submissions"),
    ("[verifier]\nnetwork = true\n", "network"),
])
def test_bad_task_toml_is_refused_naming_the_key(tmp_path, text, match):
    d = make_task(tmp_path)
    (d / "task.toml").write_text('id = "tiny-add"\nkind = "python"\ngoal = "g"\nsubmit = ["*.py"]\n' + text)
    with pytest.raises(ConfigError, match=match):
        load_task(d)
    (d / "task.toml").write_text(toml("tiny-add"))
    load_task(d)  # the positive control: the same directory with a valid file


@pytest.mark.parametrize("head,match", [
    ('id = "other"\nkind = "python"\ngoal = "g"\nsubmit = ["a"]\n', "directory name"),
    ('id = "tiny-add"\nkind = "java"\ngoal = "g"\nsubmit = ["a"]\n', "kind"),
    ('id = "tiny-add"\nkind = "python"\nsubmit = ["a"]\n', "'goal' is required"),
    ('id = "tiny-add"\nkind = "python"\ngoal = "g"\nsubmit = ["../a"]\n', "without '..'"),
    ('id = "tiny-add"\nkind = "python"\ngoal = "g"\nsubmit = []\n', "non-empty list"),
])
def test_required_fields(tmp_path, head, match):
    d = make_task(tmp_path)
    (d / "task.toml").write_text(head)
    with pytest.raises(ConfigError, match=match):
        load_task(d)
    (d / "task.toml").write_text('id = "tiny-add"\nkind = "python"\ngoal = "g"\nsubmit = ["a"]\n')
    load_task(d)  # the positive control


def test_transcripts_are_checked_against_the_tool_schema(tmp_path):
    good = [{"tool_calls": [{"name": "edit", "arguments": {"path": "a", "old": "x", "new": "y"}}]}]
    load_transcript(write_transcript(tmp_path / "ok.json", good))
    for turns, match in [
        ([{"tool_calls": [{"name": "edit", "arguments": {"path": "a", "old": "x"}}]}], "missing argument 'new'"),
        ([{"tool_calls": [{"name": "shell", "arguments": {"cmd": "ls"}}]}], "unknown argument 'cmd'"),
        ([{"tool_calls": [{"name": "browse", "arguments": {}}]}], "unknown tool"),
        ([{"thoughts": "x"}], "unknown key 'thoughts'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_transcript(write_transcript(tmp_path / "bad.json", turns))


def test_a_missing_verifier_or_solution_is_refused(tmp_path):
    d = make_task(tmp_path)
    (d / "solution" / "solve.json").unlink()
    load_task(d)
    with pytest.raises(ConfigError, match="solve.json"):
        validate_task(d)
    (d / "verifier" / "verify.py").unlink()
    with pytest.raises(ConfigError, match="verify.py"):
        load_task(d)


def test_a_task_carrying_its_own_vharness_copy_is_refused(tmp_path):
    d = make_task(tmp_path)
    assert load_task(d).id == "tiny-add"  # control: the same task without a copy loads
    (d / "verifier" / "vharness.py").write_text("# a stale copy\n")
    with pytest.raises(ConfigError, match="vharness.py"):
        load_task(d)


def test_k3_task_validate_reports_each_task(tmp_path, capsys):
    make_task(tmp_path, "good-one")
    bad = make_task(tmp_path, "bad-one")
    assert task_main(["validate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok      bad-one" in out and "ok      good-one" in out
    (bad / "task.toml").write_text(toml("bad-one", extra='colour = "red"'))
    assert task_main(["validate", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID bad-one" in out and "colour" in out and "ok      good-one" in out
    assert [p.name for p in find_tasks(tmp_path)] == ["bad-one", "good-one"]
    assert task_main(["validate", str(tmp_path / "good-one")]) == 0


PATHS = ["a.py", "src/a.py", "src/pkg/b.py", "src/x.txt", "checks/t.py", ".hidden.py", "src/.h/c.py", "a.pyc"]


@pytest.mark.parametrize("glob,expected", [
    ("*.py", {"a.py", ".hidden.py"}),
    ("src/*.py", {"src/a.py"}),
    ("src/**/*.py", {"src/a.py", "src/pkg/b.py", "src/.h/c.py"}),
    ("**/*.py", {"a.py", "src/a.py", "src/pkg/b.py", "checks/t.py", ".hidden.py", "src/.h/c.py"}),
    ("src/?.*", {"src/a.py", "src/x.txt"}),
])
def test_submit_globs_select_like_a_part_by_part_reference(glob, expected):
    def ref(pat, path):  # fnmatch per path part; ** matches any run of parts
        pp, sp = pat.split("/"), path.split("/")

        def m(i, j):
            if i == len(pp):
                return j == len(sp)
            if pp[i] == "**":
                return any(m(i + 1, k) for k in range(j, len(sp) + 1))
            return j < len(sp) and fnmatch.fnmatchcase(sp[j], pp[i]) and m(i + 1, j + 1)
        return m(0, 0)

    got = {p for p in PATHS if glob_regex(glob).match(p)}
    assert got == {p for p in PATHS if ref(glob, p)} == expected
