"""The ``screenshot`` tool (issue 34, vision in the loop): a tool result that carries an image, how
the harness sends it (a tool message of a text part and an image part; text-only results exactly
as before), how the chat renderer takes it (a media block with a vision tower, refused without),
its renaming by harness randomization, and the tool itself in a real sandbox of the ``browser``
image: the PNG it returns shows what the page drew. Every refusal has a positive control beside it."""

import base64
import io
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from k3.agent.harness import IMAGE_TOKENS, compact, estimate_tokens
from k3.agent.randomize import HarnessConfig
from k3.agent.tools import ToolBox, tool_schemas
from k3.agent.turns import AgentTurn, ToolCall, ToolResult, history_messages
from k3.config.vision import ImageProcConfig
from k3.data.chat import ChatFormat
from k3.data.tokenizer import train_tokenizer
from k3.errors import ConfigError, K3Error
from k3.tasks.format import load_task
from k3.tasks.tool_specs import DEFAULT_TOOLS, TOOL_SPECS, check_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "env"))
from task_sandboxes import sandbox_fixtures  # noqa: E402

env_root, sandboxes = sandbox_fixtures("k3env-screenshot")

RED_PAGE = "<!DOCTYPE html><html><body style='margin:0;background:#ff0000'></body></html>\n"
SPLIT_PAGE = ("<!DOCTYPE html><html><body style='margin:0;background:#ffffff'>"
              "<div style='height:50px;background:#0000ff'></div></body></html>\n")


def png_url(size=(64, 48), colour=(255, 0, 0)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def decode(url: str) -> Image.Image:
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def one_turn(result: ToolResult, name="screenshot", args=None) -> AgentTurn:
    call = ToolCall(result.call_id, name, args or {"path": "index.html"})
    return AgentTurn("", "", [call], [result], "p")


# ---------------------------------------------------------------------------------- the result
def test_a_result_with_an_image_is_a_text_part_and_an_image_part():
    url = png_url()
    shot = ToolResult("c1", "screenshot", "screenshot of index.html, 64x48", images=[url])
    msgs = history_messages("sys", "goal", [one_turn(shot)], "p")
    assert msgs[-1] == {"role": "tool", "tool_call_id": "c1",
                        "content": [{"type": "text", "text": "screenshot of index.html, 64x48"},
                                    {"type": "image_url", "image_url": {"url": url}}]}
    # the control: a text result is the plain string, and its record has no images key (as before)
    text = ToolResult("c1", "read", "hello\n")
    assert history_messages("sys", "goal", [one_turn(text, "read")], "p")[-1] == \
        {"role": "tool", "tool_call_id": "c1", "content": "hello\n"}
    assert text.as_dict() == {"call_id": "c1", "name": "read", "output": "hello\n", "error": False, "meta": {}}
    # the image survives the trajectory's record and comes back
    back = AgentTurn.from_dict(json.loads(json.dumps(one_turn(shot).as_dict())))
    assert back.tool_results[0].images == [url] and back.tool_results[0].content() == shot.content()


def test_another_providers_turn_names_the_image_it_does_not_show():
    shot = ToolResult("c1", "screenshot", "screenshot of index.html, 64x48", images=[png_url()])
    msgs = history_messages("sys", "goal", [one_turn(shot)], "other")
    assert "1 image(s) not shown" in msgs[-1]["content"] and "base64" not in msgs[-1]["content"]


def test_compaction_drops_an_old_image_with_its_output_and_counts_images_as_tokens():
    url = png_url((400, 300))
    turns = [one_turn(ToolResult(f"c{i}", "screenshot", f"shot {i}", images=[url])) for i in range(4)]
    for i, t in enumerate(turns):
        t.tool_calls[0].id = t.tool_results[0].call_id
    msgs = history_messages("sys", "goal", turns, "p")
    parts = sum(1 for m in msgs if isinstance(m["content"], list))
    assert parts == 4
    no_images = [{**m, "content": m["content"][0]["text"]} if isinstance(m["content"], list) else m for m in msgs]
    assert estimate_tokens(msgs) - estimate_tokens(no_images) == pytest.approx(4 * IMAGE_TOKENS, abs=40)
    view = compact(turns, "sliding_window", lambda v: not any(r.images for t in v[:-1] for r in t.tool_results),
                   keep_recent=1)
    kept = [r for t in view for r in t.tool_results]
    assert [bool(r.images) for r in kept] == [False, False, False, True]
    assert kept[0].output == "[output dropped to save context: 6 chars, 1 image(s)]"
    assert all(r.images == [url] for t in turns for r in t.tool_results)  # the trajectory keeps them


# ---------------------------------------------------------------------------------- the renderer
@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["screenshot of index.html, 64x48 image write the page " * 30], vocab_size=400)


def test_the_tool_message_renders_as_a_media_block_and_a_text_model_refuses_it(tok):
    url = png_url((64, 48), (10, 200, 30))
    shot = ToolResult("c1", "screenshot", "screenshot of index.html, 64x48", images=[url])
    msgs = history_messages("sys", "goal", [one_turn(shot)], "p")
    cfg = HarnessConfig()
    tools = tool_schemas(cfg, ["write", "screenshot", "submit"])
    vis = ChatFormat(tok, ImageProcConfig())
    r = vis.render_chat(msgs, tools=tools)
    assert [(im.size, im.where) for im in r.images] == [((64, 48), "messages[3].content[1]")]
    assert r.images[0].image.convert("RGB").getpixel((5, 5)) == (10, 200, 30)
    pad = tok.media_token_ids["<|media_pad|>"]
    assert r.ids.count(pad) == r.images[0].num_tokens > 0
    with pytest.raises(K3Error, match=r"messages\[3\]\.content\[1\] is an image, but this model has no vision tower"):
        ChatFormat(tok).render_chat(msgs, tools=tools)
    # the control: the same chat with a text result renders with either format, no media block
    text = history_messages("sys", "goal", [one_turn(ToolResult("c1", "screenshot", "error: no such file",
                                                                  error=True))], "p")
    assert ChatFormat(tok).render(text, tools=tools) == vis.render(text, tools=tools)
    assert pad not in ChatFormat(tok).render(text, tools=tools)


# ---------------------------------------------------------------------------------- schema, renaming
def test_the_schema_and_its_checks():
    assert "screenshot" in TOOL_SPECS and "screenshot" not in DEFAULT_TOOLS
    assert check_arguments("screenshot", {"path": "a.html", "width": 800, "height": 600}) is None
    assert check_arguments("screenshot", {"path": "a.html"}) is None
    assert check_arguments("screenshot", {"path": "a.html", "width": 80.5}) == \
        "screenshot: argument 'width' must be an integer"
    assert check_arguments("screenshot", {"path": "a.html", "width": True}) == \
        "screenshot: argument 'width' must be an integer"
    assert "missing argument 'path'" in check_arguments("screenshot", {"width": 100})


def test_randomization_renames_the_tool_and_its_arguments_and_back():
    seen_tool, seen_w = set(), set()
    for seed in range(60):
        c = HarnessConfig.from_seed(seed)
        call = ("screenshot", {"path": "index.html", "width": 320, "height": 200})
        name, args = c.to_model(*call)
        assert c.from_model(name, args) == call
        (schema,) = tool_schemas(c, ["screenshot"])
        fn = schema["function"]
        assert fn["name"] == name and set(fn["parameters"]["properties"]) == set(args)
        assert fn["parameters"]["required"] == [c.arg_names["path"]]
        assert fn["parameters"]["properties"][c.arg_names["width"]]["type"] == "integer"
        seen_tool.add(name)
        seen_w.add(c.arg_names["width"])
    assert len(seen_tool) > 1 and len(seen_w) > 1


def test_a_config_recorded_before_the_screenshot_tool_still_loads():
    d = HarnessConfig.from_seed(11).as_dict()
    for k in ("screenshot",):
        d["tool_names"].pop(k)
    for k in ("width", "height"):
        d["arg_names"].pop(k)
    c = HarnessConfig.from_dict(d)
    assert c.tool_names["screenshot"] == "screenshot" and c.arg_names["width"] == "width"
    assert {k: v for k, v in c.tool_names.items() if k != "screenshot"} == d["tool_names"]
    with pytest.raises(ConfigError, match="distinct"):  # the control: a real clash is still refused
        HarnessConfig.from_dict({**d, "tool_names": {**d["tool_names"], "read": "screenshot"}})


def _task(tmp_path, extra: str) -> Path:
    d = tmp_path / "t1"
    (d / "workspace").mkdir(parents=True, exist_ok=True)
    (d / "verifier").mkdir(exist_ok=True)
    (d / "verifier" / "verify.py").write_text("")
    (d / "task.toml").write_text('id = "t1"\nkind = "data"\ngoal = "g"\nsubmit = ["index.html"]\n' + extra)
    return d


def test_a_task_gets_screenshot_only_when_it_lists_it_and_then_needs_the_browser_image(tmp_path):
    assert "screenshot" not in load_task(_task(tmp_path, "")).allowed_tools
    assert load_task(_task(tmp_path, "")).image == "default"
    listed = '[tools]\nallowed = ["write", "screenshot", "submit"]\n'
    with pytest.raises(ConfigError, match="'screenshot', which needs image = \"browser\""):
        load_task(_task(tmp_path, listed))
    t = load_task(_task(tmp_path, 'image = "browser"\n' + listed))  # the control
    assert t.image == "browser" and t.allowed_tools == ["write", "screenshot", "submit"]
    with pytest.raises(ConfigError, match="image must be one of"):
        load_task(_task(tmp_path, 'image = "gpu"\n'))


# ---------------------------------------------------------------------------------- in a sandbox
def test_the_screenshot_shows_what_the_page_drew(sandboxes):
    with sandboxes.create(image="browser") as sb:
        box = ToolBox(sb)
        assert not box.run("write", {"path": "red.html", "content": RED_PAGE}).error
        assert not box.run("write", {"path": "pages/split.html", "content": SPLIT_PAGE}).error
        r = box.run("screenshot", {"path": "red.html", "width": 200, "height": 120})
        assert not r.error and r.output == "screenshot of red.html, 200x120" and len(r.images) == 1, r.output
        im = decode(r.images[0])
        assert im.size == (200, 120)
        assert {im.getpixel((x, y)) for x in (1, 100, 198) for y in (1, 60, 118)} == {(255, 0, 0)}
        r = box.run("screenshot", {"path": "pages/split.html"})  # the default size; a blue band over white
        im = decode(r.images[0])
        assert not r.error and im.size == (640, 480) and r.meta["width"] == 640
        assert im.getpixel((320, 20)) == (0, 0, 255) and im.getpixel((320, 300)) == (255, 255, 255)
        # errors are results naming the problem
        missing = box.run("screenshot", {"path": "nope.html"})
        assert missing.error and missing.output == "error: nope.html: no such file" and not missing.images
        out = box.run("screenshot", {"path": "../etc/hosts.html"})
        assert out.error and "outside the working directory" in out.output and not out.images
        box.run("shell", {"command": "ln -s /etc/hostname escape.html"})
        link = box.run("screenshot", {"path": "escape.html"})
        assert link.error and "leads outside the working directory" in link.output
        size = box.run("screenshot", {"path": "red.html", "width": 4000})
        assert size.error and "width 4000 is out of range (64 to 1600)" in size.output
        kind = box.run("screenshot", {"path": "notes.doc"})
        assert kind.error and "not a page or image file" in kind.output
        box.run("write", {"path": "spin.html", "content": "<script>for(;;){}</script>"})
        slow = box.run("screenshot", {"path": "spin.html"}, timeout_cap=6)
        assert slow.error and "timed out" in slow.output and slow.meta["timed_out"]
        left = box.run("shell", {"command": "ps -eo comm | grep -c chrom; ls /tmp | grep -c k3-"})
        assert left.output.split("\n")[1:3] == ["0", "0"], left.output  # no browser and no file left behind
        again = box.run("screenshot", {"path": "red.html", "width": 64, "height": 64})  # still works
        assert not again.error and decode(again.images[0]).getpixel((32, 32)) == (255, 0, 0)


def test_a_sandbox_without_the_browser_says_so(sandboxes):
    with sandboxes.create() as sb:
        box = ToolBox(sb)
        box.write_text("red.html", RED_PAGE)
        r = box.run("screenshot", {"path": "red.html"})
        assert r.error and "no headless browser" in r.output and 'image = "browser"' in r.output
        assert box.run("read", {"path": "red.html"}).output == RED_PAGE  # the control: the sandbox works
