"""The ``page`` family (domain ``coding_agent``; tools write, screenshot, shell, submit; image
``browser``): write index.html, a white page with a coloured header band and a round button, and
look at it with the ``screenshot`` tool before submitting. Vision in the loop: the agent sees its
page as an image (k3.agent.tools), and the hidden verifier judges rendered pixels only.

An instance draws the header's colour and the button's (two different colours of ``PALETTE``).
The goal fixes what the verifier measures: a white page; a header (id ``header``) 100px tall
across the top in the header colour; below it an empty button (id ``go``) of 120x120px, no
border, border-radius 50%, in the button colour.

The hidden verifier renders the submitted index.html with the sandbox's headless Chromium (the
``browser`` image) at 640x480 in a vharness child (an untrusted process: the page may run
script), to a file of a fresh random name it made the child write, and checks the pixels: the
page's bottom-right corner is white; the header band (rows 14..86, x 16..624) has the header
colour; the pixels of the button colour form a box of 120x120 (±6) below the header whose centre
has the button colour, whose corners and diagonal points 12px in show the white page (a square or
slightly rounded button fails there) and which the colour fills like a disc (π/4 ± 0.03: a
border-radius of 47% or more passes, 45% fails). Colours match within ``TOLERANCE`` per channel.
Nothing else the agent wrote is read: a screenshot file in the submission (``*.png`` is
submitted, for images a page may show) never counts.

The scripted solver writes index.html (its layout drawn from the seed: the button's distance below
the header and its alignment), takes one screenshot, and submits. ``low`` says next to nothing;
``high`` explains the CSS and what the screenshot shows; ``max`` also checks the CSS with grep
before submitting. Hacks (each scores 0): a header of another colour; a square button (radius
8px); a correct page's real screenshot saved as screenshot.png beside a page with the wrong
header colour.
"""

from __future__ import annotations

import random

from k3.tasks.families.base import Family, TaskFiles, shell_output

__all__ = ["Page", "PALETTE", "TOLERANCE", "page_html", "verifier_source"]

PALETTE = {"red": "#d62828", "blue": "#1d4ed8", "green": "#2a9d3f", "orange": "#f77f00", "purple": "#7b2cbf",
           "teal": "#0f8b8d", "pink": "#e0457b", "brown": "#8b5a2b"}
TOLERANCE = 12
VIEW = (640, 480)
HEADER_PX, BUTTON_PX = 100, 120
PAGE = "index.html"
SHOT_TEXT = f"screenshot of {PAGE}, {VIEW[0]}x{VIEW[1]}"
ALIGN = {"left": "margin-left: 40px;", "center": "margin-left: auto; margin-right: auto;",
         "right": "margin-left: auto; margin-right: 40px;"}
GREP = "grep -o 'border-radius: 50%' index.html"


def page_html(header: str, button: str, top: int = 40, align: str = "center", radius: str = "50%") -> str:
    """index.html with a ``header``-coloured band and a ``button``-coloured button of ``radius``."""
    return ("<!DOCTYPE html>\n<html>\n<head>\n<style>\n"
            "body { margin: 0; background: #ffffff; }\n"
            f"#header {{ height: {HEADER_PX}px; background: {header}; }}\n"
            f"#go {{ display: block; margin-top: {top}px; {ALIGN[align]} width: {BUTTON_PX}px; "
            f"height: {BUTTON_PX}px; border: none; border-radius: {radius}; background: {button}; }}\n"
            "</style>\n</head>\n<body>\n<div id=\"header\"></div>\n<button id=\"go\"></button>\n</body>\n</html>\n")


def _call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


class Page(Family):
    name = "page"
    domain = "coding_agent"
    about = "write index.html with a coloured header and a round button; look at it; pixels are checked"
    vision = True  # its tool results carry images: only a model with a vision tower can run it

    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        header, button = rng.sample(sorted(PALETTE), 2)
        wrong = rng.choice([c for c in sorted(PALETTE) if c not in (header, button)])
        spec = {"header": header, "header_hex": PALETTE[header], "button": button, "button_hex": PALETTE[button],
                "top": rng.choice((20, 40, 60, 80, 120)), "align": rng.choice(sorted(ALIGN))}
        spec["page"] = page_html(spec["header_hex"], spec["button_hex"], spec["top"], spec["align"])
        goal = (f"Write {PAGE}: a white page whose header (id \"header\") is {_a(header)} ({PALETTE[header]}) band "
                f"{HEADER_PX}px tall across the top, and below it an empty round button (id \"go\", "
                f"{BUTTON_PX}x{BUTTON_PX}px, no border, border-radius 50%) coloured {button} ({PALETTE[button]}). "
                f"It is judged by how it looks at {VIEW[0]}x{VIEW[1]}. Look at it with screenshot, then submit.")
        wrong_header = page_html(PALETTE[wrong], spec["button_hex"], spec["top"], spec["align"])
        square = page_html(spec["header_hex"], spec["button_hex"], spec["top"], spec["align"], radius="8px")
        shoot = (f"chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars "
                 f"--user-data-dir=/tmp/hack-profile --screenshot=/workspace/screenshot.png "
                 f"--window-size={VIEW[0]},{VIEW[1]} file:///workspace/{PAGE} >/dev/null 2>&1; ls screenshot.png")
        hacks = {
            "wrong-header-colour": (f"the header is {wrong}, not {header}", [
                {"reasoning": "", "content": "", "tool_calls": [_call("write", path=PAGE, content=wrong_header),
                                                                _call("submit")]}]),
            "square-button": ("the button's corners are barely rounded (8px)", [
                {"reasoning": "", "content": "", "tool_calls": [_call("write", path=PAGE, content=square),
                                                                _call("submit")]}]),
            "screenshot-file": ("a correct page's real render saved as screenshot.png, then a page with the "
                                "wrong header submitted beside it", [
                {"reasoning": "", "content": "", "tool_calls": [_call("write", path=PAGE, content=spec["page"]),
                                                                _call("shell", command=shoot, timeout=60)]},
                {"reasoning": "", "content": "", "tool_calls": [_call("write", path=PAGE, content=wrong_header),
                                                                _call("submit")]}]),
        }
        return TaskFiles(kind="data", goal=goal, submit=[PAGE, "*.css", "*.png"],
                         tools=["write", "screenshot", "shell", "submit"], spec=spec, workspace={},
                         verifier=verifier_source(PALETTE[header], PALETTE[button]), hacks=hacks,
                         budget={"steps": 8, "tokens": 12000, "wall_seconds": 180, "submissions": 1},
                         verifier_timeout=120, image="browser")

    def turns(self, spec: dict, effort: str) -> list[dict]:
        h, b = spec["header"], spec["button"]
        write_look = [_call("write", path=PAGE, content=spec["page"]), _call("screenshot", path=PAGE)]
        final = {"reasoning": "" if effort == "low" else "Submitted.",
                 "content": f"{PAGE} has a {h} header and a round {b} button."}
        if effort == "low":
            return [{"reasoning": "", "content": "", "tool_calls": write_look},
                    {"reasoning": "", "content": "", "tool_calls": [_call("submit")]}, final]
        plan = (f"The page needs a {h} header band {HEADER_PX}px tall at the top and a round {b} button below it. "
                f"body margin 0 lets the header span the whole width; #header gets height {HEADER_PX}px and "
                f"background {spec['header_hex']}. #go is a block {BUTTON_PX}px square with no border; "
                f"border-radius 50% makes it a circle, background {spec['button_hex']}. "
                f"I write it, then look at the screenshot.")
        seen = (f"The screenshot shows a {h} band across the top and, {spec['top']}px below it on the "
                f"{spec['align']}, a {b} circle on white: the corners around the button are white, so it is round.")
        if effort == "high":
            return [{"reasoning": plan, "content": "", "tool_calls": write_look},
                    {"reasoning": seen + " It matches the goal. Submit.", "content": "",
                     "tool_calls": [_call("submit")]}, final]
        return [{"reasoning": plan + " At max effort I also check the CSS text afterwards.", "content": "",
                 "tool_calls": write_look},
                {"reasoning": seen + " Check that the radius really is 50% in the file: " + GREP, "content": "",
                 "tool_calls": [_call("shell", command=GREP)]},
                {"reasoning": "grep found border-radius: 50%, and the screenshot agrees: the header colour, the "
                              "round button, the white page. Submit.", "content": "",
                 "tool_calls": [_call("submit")]}, final]

    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        grep = [shell_output("border-radius: 50%\n")] if effort == "max" else []
        return [None, SHOT_TEXT] + grep + [None]  # write, screenshot, [shell], submit


def verifier_source(header_hex: str, button_hex: str) -> str:
    """verify.py (on k3's vharness, stdlib only) for one instance's two colours (module doc)."""
    return f'''"""Hidden verifier: index.html rendered by headless Chromium at {VIEW[0]}x{VIEW[1]}; its pixels."""
import os
import secrets
import struct
import sys
import urllib.parse
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

HEADER = {_rgb(header_hex)!r}
BUTTON = {_rgb(button_hex)!r}
WHITE = (255, 255, 255)
W, H = {VIEW[0]}, {VIEW[1]}
HEADER_PX, BUTTON_PX, TOL = {HEADER_PX}, {BUTTON_PX}, {TOLERANCE}
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--mute-audio", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--force-color-profile=srgb", "--disable-crash-reporter",
         "--host-resolver-rules=MAP * ~NOTFOUND"]


def decode_png(data):
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    if data[:8] != b"\\x89PNG\\r\\n\\x1a\\n":
        raise vharness.Fail("the render is not a PNG")
    pos, idat, ihdr = 8, [], None
    while pos + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if ihdr is None or ihdr[2] != 8 or ihdr[3] not in (2, 6) or ihdr[6] != 0:
        raise vharness.Fail("the render is a PNG this verifier does not read: %r" % (ihdr,))
    w, h, bpp = ihdr[0], ihdr[1], 3 if ihdr[3] == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), w * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        if f == 1:
            for x in range(bpp, stride):
                line[x] = (line[x] + line[x - bpp]) & 255
        elif f == 2:
            for x in range(stride):
                line[x] = (line[x] + prev[x]) & 255
        elif f == 3:
            for x in range(stride):
                line[x] = (line[x] + ((line[x - bpp] if x >= bpp else 0) + prev[x]) // 2) & 255
        elif f == 4:
            for x in range(stride):
                a, b = (line[x - bpp] if x >= bpp else 0), prev[x]
                c = prev[x - bpp] if x >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        elif f != 0:
            raise vharness.Fail("the render has a bad PNG filter %d" % f)
        rows.append(line)
        prev = line
    return w, h, [bytes(r) if bpp == 3 else bytes(v for j, v in enumerate(r) if j % 4 != 3) for r in rows]


def near(px, want):
    return all(abs(a - b) <= TOL for a, b in zip(px, want))


def hexc(px):
    return "#%02x%02x%02x" % tuple(px)


def render(ctx):
    cwd = ctx.fresh()
    page = os.path.join(cwd, "index.html")
    if os.path.islink(page) or not os.path.isfile(page):
        raise vharness.Fail("missing file: index.html")
    out = os.path.join(cwd, ".k3-render-%s.png" % secrets.token_hex(12))  # a name nothing submitted can have
    profile = os.path.join(ctx.home, "chromium-%s" % secrets.token_hex(8))
    argv = [CHROMIUM] + FLAGS + ["--user-data-dir=" + profile, "--screenshot=" + out, "--window-size=%d,%d" % (W, H),
                                 "file://" + urllib.parse.quote(page)]
    res = ctx.run(argv, cwd, timeout=90.0)
    if os.path.islink(out) or not os.path.isfile(out):
        raise vharness.Fail("the page did not render (exit %d): %s" % (res.returncode, res.stderr.strip()[-300:]))
    with open(out, "rb") as f:
        return decode_png(f.read())


def check(ctx):
    w, h, rows = render(ctx)
    if (w, h) != (W, H):
        raise vharness.Fail("the render is %dx%d, not %dx%d" % (w, h, W, H))
    px = lambda x, y: rows[y][3 * x:3 * x + 3]  # noqa: E731
    if not near(px(W - 4, H - 4), WHITE):
        raise vharness.Fail("the page is %s at its bottom right, not white" % hexc(px(W - 4, H - 4)))
    for y in (14, HEADER_PX // 2, HEADER_PX - 14):
        for x in range(16, W - 15, 16):
            if not near(px(x, y), HEADER):
                raise vharness.Fail("the header band is %s at (%d, %d), want %s" % (hexc(px(x, y)), x, y, hexc(HEADER)))
    x0 = y0 = 1 << 30
    x1 = y1 = -1
    count = 0
    for y in range(H):
        row = rows[y]
        for x in range(W):
            if near(row[3 * x:3 * x + 3], BUTTON):
                count += 1
                x0, x1, y0, y1 = min(x0, x), max(x1, x), min(y0, y), max(y1, y)
    if not count:
        raise vharness.Fail("no pixel has the button colour %s" % hexc(BUTTON))
    bw, bh = x1 - x0 + 1, y1 - y0 + 1
    if abs(bw - BUTTON_PX) > 6 or abs(bh - BUTTON_PX) > 6:
        raise vharness.Fail("the button colour covers a %dx%d box, want %dx%d" % (bw, bh, BUTTON_PX, BUTTON_PX))
    if y0 < HEADER_PX - 4:
        raise vharness.Fail("the button starts at y=%d, inside the header" % y0)
    cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
    if not near(px(cx, cy), BUTTON):
        raise vharness.Fail("the button's centre is %s, want %s" % (hexc(px(cx, cy)), hexc(BUTTON)))
    for d in (2, 12):
        for x, y in ((x0 + d, y0 + d), (x1 - d, y0 + d), (x0 + d, y1 - d), (x1 - d, y1 - d)):
            if not near(px(x, y), WHITE):
                raise vharness.Fail("the button's box shows %s at (%d, %d), %dpx in from a corner, not the white "
                                    "page: the button is not round" % (hexc(px(x, y)), x, y, d))
    fill = count / float(bw * bh)
    if abs(fill - 0.7854) > 0.03:
        raise vharness.Fail("the button colour fills %.3f of its box; a disc fills 0.785" % fill)
    return 1.0, "header %s, round %s button of %dx%d at (%d, %d), filling %.3f of its box" % (
        hexc(HEADER), hexc(BUTTON), bw, bh, x0, y0, fill)


if __name__ == "__main__":
    vharness.main(check, __file__)
'''


def _rgb(hexcolour: str) -> tuple[int, int, int]:
    return tuple(int(hexcolour[i:i + 2], 16) for i in (1, 3, 5))


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word
