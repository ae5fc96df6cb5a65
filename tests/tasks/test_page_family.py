"""The ``page`` family (issue 34, vision in the loop): deterministic valid tasks of the ``browser``
image, a scripted solver that looks at its page once before it submits and scores 1.0 through the
real harness, sandboxes and clean-room verifier, hacks and wrong pages scoring 0 the same way (a
positive control beside each), and a verifier that judges rendered pixels only."""

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from k3.agent.providers import render_request
from k3.agent.randomize import HarnessConfig
from k3.agent.tools import ToolBox
from k3.config.vision import ImageProcConfig
from k3.data.chat import ChatFormat
from k3.data.tokenizer import train_tokenizer
from k3.errors import K3Error
from k3.rl.rollout import run_episode
from k3.rl.trajectory import TrajectoryWriter
from k3.tasks.families import EFFORTS, FAMILIES, HELDOUT_START, VISION_FAMILIES, get_family, read_meta
from k3.tasks.families.page import PALETTE, SHOT_TEXT, page_html
from k3.tasks.format import load_task, validate_task
from k3.tasks.verify import Submission, verify
from test_families_chat import Recording   # the Scripted provider that keeps its requests

FAM = get_family("page")


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def calls(turns) -> list[dict]:
    return [c for t in turns for c in t.get("tool_calls", [])]




def episode(task_dir, turns, sandboxes, effort=None, harness=None):
    w, p = TrajectoryWriter(), Recording(turns)
    s = run_episode(task_dir, p, w, sandboxes=sandboxes, effort=effort, harness=harness)
    return s, w.records, p


def decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def rgb(hexcolour: str) -> tuple:
    return tuple(int(hexcolour[i:i + 2], 16) for i in (1, 3, 5))


def test_the_family_is_found_by_name_and_kept_apart_from_the_text_families():
    assert FAM is VISION_FAMILIES["page"] and "page" not in FAMILIES and FAM.vision
    assert (FAM.name, FAM.domain) == ("page", "coding_agent")


def test_generation_is_deterministic_and_tasks_are_valid(tmp_path):
    a, b = FAM.generate(5, tmp_path / "a"), FAM.generate(5, tmp_path / "b")
    assert tree(a) == tree(b) and tree(FAM.generate(6, tmp_path / "a")) != tree(a)
    assert len({json.dumps(FAM.spec(s), sort_keys=True) for s in range(30)}) > 20
    for seed in (*range(6), HELDOUT_START + 1):
        d = FAM.generate(seed, tmp_path / "v")
        t = validate_task(d)
        spec = FAM.spec(seed)
        assert t.image == "browser" and "screenshot" in t.allowed_tools and t.domain is None
        assert spec["header"] != spec["button"] and spec["header_hex"] in t.goal and spec["button_hex"] in t.goal
        assert t.solution.expect_reward == 1.0 and len(t.hacks) == 3
        assert all(h.expect_reward == 0.0 for h in t.hacks)
        meta = read_meta(d)
        assert (meta["family"], meta["domain"], meta["split"]) == \
            ("page", "coding_agent", "train" if seed < HELDOUT_START else "heldout")
        assert not list((d / "workspace").iterdir())  # the agent starts from an empty workdir


def test_every_effort_looks_once_before_it_submits_and_effort_is_real():
    for seed in range(20):
        spec = FAM.spec(seed)
        by = {e: FAM.solve(spec, e) for e in EFFORTS}
        for e, turns in by.items():
            names = [c["name"] for c in calls(turns)]
            assert names.count("screenshot") == 1 and names[-1] == "submit", (e, names)
            assert names.index("write") < names.index("screenshot")
            # the submit comes in a later turn than the screenshot: the solver saw the image first
            turn_of = {c["name"]: i for i, t in enumerate(turns) for c in t.get("tool_calls", [])}
            assert turn_of["submit"] > turn_of["screenshot"]
        lens = [len("".join(t.get("reasoning") or "" for t in by[e])) for e in EFFORTS]
        assert lens[0] < lens[1] < lens[2], (seed, lens)
        assert [c["name"] for c in calls(by["max"])] == ["write", "screenshot", "shell", "submit"]
        assert FAM.expected_outputs(spec, "high")[1] == SHOT_TEXT


@pytest.mark.slow
def test_the_reference_solution_scores_one_and_sees_its_page(tmp_path, sandboxes):
    d = FAM.generate(0, tmp_path)
    spec, task = FAM.spec(0), validate_task(d)
    s, recs, prov = episode(d, task.solution.turns, sandboxes, effort=FAM.solution_effort)
    assert (s["score"], s["status"]) == (1.0, "completed"), s["verdicts"]
    assert "round" in s["verdicts"][0]["reason"] and "isolation" in s["verdicts"][0]["reason"]
    tools = [r for r in recs if r["type"] == "tool"]
    assert FAM.check_outputs(spec, FAM.solution_effort, [r["result"]["output"] for r in tools]) is None
    (shot,) = [r for r in tools if r["name"] == "screenshot"]
    im = decode(shot["result"]["images"][0])  # the trajectory keeps the image the model saw
    assert im.size == (640, 480)
    assert im.getpixel((320, 50)) == rgb(spec["header_hex"]) and im.getpixel((630, 470)) == (255, 255, 255)
    assert rgb(spec["button_hex"]) in {im.getpixel((x, y)) for x in range(0, 640, 10) for y in range(100, 480, 10)}
    # the request after the screenshot carries it as an image part of its tool message
    req = prov.requests[1]
    (msg,) = [m for m in req.messages if m["role"] == "tool" and isinstance(m["content"], list)]
    assert msg["content"][0] == {"type": "text", "text": SHOT_TEXT}
    assert msg["content"][1]["image_url"]["url"] == shot["result"]["images"][0]
    # rendered as LocalEngine renders it: a media block for a model with a tower, refused without one
    tok = train_tokenizer([json.dumps(spec) * 20], vocab_size=400)
    r = render_request(ChatFormat(tok, ImageProcConfig()), req)
    assert [im.size for im in r.images] == [(640, 480)]
    with pytest.raises(K3Error, match="has no vision tower"):
        render_request(ChatFormat(tok), req)


@pytest.mark.slow
def test_the_hacks_score_zero_through_the_same_path(tmp_path, sandboxes):
    d = FAM.generate(1, tmp_path)
    task = validate_task(d)
    for hack in task.hacks:
        s, recs, _ = episode(d, hack.turns, sandboxes)
        assert s["submissions"] == 1 and s["score"] == 0.0, (hack.path.name, s["verdicts"])
        assert "isolation" in s["verdicts"][0]["reason"]  # a verdict of the real verifier, not a refusal
        if hack.path.name == "screenshot-file.json":  # the positive control of the hack: a real render went in
            (sub,) = [r for r in recs if r["type"] == "submission"]
            assert set(sub["manifest"]["files"]) == {"index.html", "screenshot.png"}
    # the control of the control: the solution through the very same task scores 1.0
    assert episode(d, task.solution.turns, sandboxes)[0]["score"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("effort", ["low", "max"])
def test_the_other_efforts_pass_under_a_randomized_harness(tmp_path, sandboxes, effort):
    seed = HELDOUT_START + 2
    d = FAM.generate(seed, tmp_path)
    harness = next(h for h in range(100) if HarnessConfig.from_seed(h).tool_names["screenshot"] != "screenshot"
                   and HarnessConfig.from_seed(h).arg_names["path"] != "path")
    s, recs, _ = episode(d, FAM.solve(d, effort), sandboxes, effort=effort, harness=harness)
    assert (s["score"], s["status"]) == (1.0, "completed"), s["verdicts"]
    sent = [t["function"]["name"] for t in recs[0]["conditions"]["tools"]]
    cfg = recs[0]["conditions"]["harness"]
    assert cfg["tool_names"]["screenshot"] in sent and "screenshot" not in sent  # renamed as sent
    shot = next(t["function"] for t in recs[0]["conditions"]["tools"]
                if t["function"]["name"] == cfg["tool_names"]["screenshot"])
    assert set(shot["parameters"]["properties"]) == {cfg["arg_names"][a] for a in ("path", "width", "height")}
    outputs = [r["result"]["output"] for r in recs if r["type"] == "tool"]
    assert FAM.check_outputs(FAM.spec(seed), effort, outputs) is None


@pytest.mark.slow
def test_the_verifier_reads_pixels_only(tmp_path, sandboxes):
    d = FAM.generate(2, tmp_path)
    task, spec = load_task(d), FAM.spec(2)
    good = page_html(spec["header_hex"], spec["button_hex"], 60, "right").encode()
    other = next(c for c in PALETTE.values() if c not in (spec["header_hex"], spec["button_hex"]))

    def score(files):
        v = verify(task, Submission(files, {}), sandboxes)
        assert "isolation" in v.reason, v.reason
        return v.reward, v.reason

    assert score({"index.html": good})[0] == 1.0  # the positive control
    cases = {
        "radius 40%": page_html(spec["header_hex"], spec["button_hex"], 60, "right", "40%").encode(),
        "no header": page_html("#ffffff", spec["button_hex"]).encode(),
        "header of the button colour": page_html(spec["button_hex"], spec["button_hex"]).encode(),
        "button of another colour": page_html(spec["header_hex"], other).encode(),
        # the right colours said in words, not drawn
        "text only": f"<p>header {spec['header_hex']}, round button {spec['button_hex']}</p>".encode(),
    }
    for what, page in cases.items():
        reward, reason = score({"index.html": page})
        assert reward == 0.0, (what, reason)
    # a correct render as a file, with no page or a wrong page, never counts
    with sandboxes.create(image="browser") as sb:
        box = ToolBox(sb)
        box.write_text("index.html", good.decode())
        png = base64.b64decode(box.run("screenshot", {"path": "index.html"}).images[0].split(",", 1)[1])
    reward, reason = score({"screenshot.png": png})
    assert reward == 0.0 and "missing file: index.html" in reason
    assert score({"index.html": cases["no header"], "screenshot.png": png})[0] == 0.0
    assert score({"index.html": good, "screenshot.png": png})[0] == 1.0  # beside a good page it is harmless
