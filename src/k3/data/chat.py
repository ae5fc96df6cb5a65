"""The chat format (SPEC §6.3): OpenAI-style messages -> token ids, SFT loss masks, thinking caps.

A message renders as ``<|im_{role}|>{role}<|im_middle|>{body}<|im_end|>`` (a tool result as
``<|im_system|>tool``); an assistant body is ``<think>{reasoning}</think>{content}`` followed, when
it calls tools, by ``<|tool_calls_section_begin|>`` + per call ``<|tool_call_begin|>{id}
<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`` + ``<|tool_calls_section_end|>``, with
``id = functions.{name}:{i}``. The generation prompt is ``<|im_assistant|>assistant<|im_middle|>
<think>``. The system turn carries the tools and the reasoning effort (docs/CHAT.md has the exact
text). Markers are inserted as ids; every text piece is encoded as ordinary text, so a literal
``<|im_end|>`` in a message stays bytes.

Preserved thinking: every assistant turn keeps its reasoning and rendering is a pure function of
the messages, so the prompt of turn N+1 starts with the ids of turn N's prompt plus its generated
tokens (when those are the tokenizer's own encoding of the text, which greedy BPE output is not
always; the prefix cache then hits up to the first differing token).

Images (SPEC §3.9, issue 34): a user or tool message's content may hold OpenAI image parts,
``{"type": "image_url", "image_url": {"url": U}}`` with U a ``data:image/...;base64`` URL or a file
path (relative paths under ``base_dir``; http(s) refused: no network). Each renders in place, as the
release does, as ``<|media_begin|>image {W}x{H}<|media_content|>`` + N × ``<|media_pad|>`` +
``<|media_end|>`` with the image's original W×H and N = ``ImageProcConfig.num_tokens(W, H)``; the
vision tower's rows replace the pads in prompt order. :meth:`ChatFormat.render_chat` returns the
ids with the decoded images in that order; ``render`` / ``render_for_training`` stay text-only and
refuse an image part (their callers would drop it).

An assistant message may carry ``weight`` (OpenAI's fine-tuning field): 1 (the default) trains
its body, 0 renders it as context with no loss (a row that trains only its last turn, e.g. one
turn of a compacted episode, ``k3.rl.trajectory.to_turn_chats``); the ids are the same either way.

The streaming parser (ids -> reasoning, content, tool calls) is ``k3.data.chat_parser``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from PIL import Image

from k3.config.vision import ImageProcConfig
from k3.data.chat_parser import TOOL_CALL_ID, ChatParser
from k3.data.images import MAX_IMAGE_PIXELS, open_image
from k3.data.tokenizer import CHAT_TOKENS, Tokenizer
from k3.errors import K3Error

__all__ = ["ChatFormat", "ChatImage", "RenderedChat", "EFFORTS", "DEFAULT_EFFORT", "THINKING_CAPS",
           "thinking_budget", "CHAT_TOKENS", "canonical_json"]

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"  # what the server uses when a request names none (SPEC §6.4)
# Thinking-token caps per effort for small models; None = unlimited (only max_tokens bounds it).
THINKING_CAPS: dict[str, int | None] = {"low": 512, "high": 4096, "max": None}
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ROLE_KEYS = {"system": {"content"}, "user": {"content"}, "tool": {"content", "tool_call_id", "name"},
              "assistant": {"content", "reasoning_content", "reasoning", "tool_calls", "weight"}}
# Fields OpenAI clients echo back on messages; accepted only while empty.
_EMPTY_OK = {"name", "refusal", "audio", "function_call", "annotations", "tool_calls"}


def thinking_budget(effort: str | None = None, caps: Mapping[str, int | None] | None = None) -> int | None:
    """Thinking tokens allowed for ``effort`` (None -> DEFAULT_EFFORT): low 512, high 4096, max None.

    ``caps`` overrides the table (e.g. larger caps for a large model). None means no cap of its own;
    at the cap the engine emits ``</think>`` itself and the answer follows.
    """
    table = THINKING_CAPS if caps is None else dict(caps)
    effort = DEFAULT_EFFORT if effort is None else effort
    if effort not in table:
        raise K3Error(f"reasoning_effort must be one of {', '.join(table)}, got {effort!r}")
    cap = table[effort]
    if cap is not None and (not isinstance(cap, int) or cap < 0):
        raise K3Error(f"thinking cap for {effort!r} must be an int >= 0 or None, got {cap!r}")
    return cap


def canonical_json(obj: Any) -> str:
    """The one JSON spelling the renderer uses (sorted keys, no spaces, UTF-8 kept)."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


@dataclass
class ChatImage:
    """An image of a chat, in prompt order: where it came from, its original size, its pixels."""
    where: str                  # e.g. "messages[1].content[0]"
    source: str                 # the URL or path as sent
    size: tuple[int, int]       # original (W, H), the prompt's "image {W}x{H}"
    num_tokens: int             # its <|media_pad|> count
    image: Image.Image          # decoded, in the file's own mode (k3.data.images.preprocess takes it)


@dataclass
class RenderedChat:
    """``render_chat``'s result: token ids, the SFT loss mask, and the images in prompt order."""
    ids: list[int]
    mask: list[int]
    images: list[ChatImage] = field(default_factory=list)


def _check_unicode(out: str, where: str) -> str:
    try:
        out.encode("utf-8")
    except UnicodeEncodeError:
        raise K3Error(f"{where} is not valid Unicode (a lone surrogate)") from None
    return out


def _image_url(part: Mapping, where: str) -> str:
    """The URL of an ``image_url`` part (``{"url": U, "detail"?: "auto"}``, or U itself)."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        url = spec
    elif isinstance(spec, Mapping):
        unknown = set(spec) - {"url", "detail"}
        if unknown:
            raise K3Error(f"{where}.image_url has unknown fields {sorted(unknown)}")
        if spec.get("detail", "auto") != "auto":
            raise K3Error(f"{where}.image_url.detail {spec.get('detail')!r} is not supported: k3 sees "
                          "every image at its own resolution (send 'auto' or leave it out)")
        url = spec.get("url")
    else:
        url = None
    if not isinstance(url, str) or not url:
        raise K3Error(f"{where}.image_url.url must be a non-empty string (a data: URL or a file path)")
    return url


def _content(value: Any, where: str, images: bool = False, optional: bool = False) -> list:
    """A message content as segments: one str (text parts joined), or, where ``images`` is allowed,
    str runs and image URLs (``_ImageRef``) in order. A str content is one segment."""
    if value is None and optional:
        return [""]
    if isinstance(value, str):
        return [_check_unicode(value, where)]
    if not isinstance(value, list):
        raise K3Error(f"{where} must be a string or a list of content parts, got {type(value).__name__}")
    segs: list = [""]
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if isinstance(segs[-1], str):
                segs[-1] += part["text"]
            else:
                segs.append(part["text"])
        elif kind == "image_url" and images:
            segs.append(_ImageRef(f"{where}[{j}]", _image_url(part, f"{where}[{j}]")))
        elif kind == "image_url":
            raise K3Error(f"{where}[{j}]: an image part is not allowed in this message "
                          "(images go in user and tool messages)")
        else:
            allowed = "'text' (with a str 'text') or 'image_url'" if images else "'text' (with a str 'text')"
            raise K3Error(f"{where}[{j}]: a content part must be of type {allowed}, got type {kind!r}")
    for seg in segs:
        if isinstance(seg, str):
            _check_unicode(seg, where)
    return segs


def _text(value: Any, where: str, optional: bool = False) -> str:
    """A text-only content: a str, or a list of ``{"type": "text", "text": str}`` parts (joined)."""
    return _content(value, where, optional=optional)[0]


@dataclass(frozen=True)
class _ImageRef:
    where: str
    url: str


@dataclass
class _Images:
    """The images one render collects, and where relative paths lie."""
    base_dir: str | os.PathLike | None
    items: list[ChatImage] = field(default_factory=list)


def _reasoning(m: Mapping, where: str) -> str | None:
    a, b = m.get("reasoning_content"), m.get("reasoning")
    if a is not None and b is not None and a != b:
        raise K3Error(f"{where}: reasoning_content and reasoning differ; send one")
    r = a if a is not None else b
    return None if r is None else _text(r, f"{where}.reasoning_content")


class _Calls:
    """Tool calls rendered so far: the id each was sent with -> the id it rendered as."""

    def __init__(self):
        self.rendered: dict[str, str] = {}
        self.names: dict[str, str] = {}  # rendered id -> function name
        self.count = 0

    def add(self, sent_id: str | None, rendered_id: str, name: str) -> None:
        if sent_id:
            self.rendered[sent_id] = rendered_id
        self.rendered[rendered_id] = rendered_id
        self.names[rendered_id] = name
        self.count += 1


class ChatFormat:
    """Renderer of SPEC §6.3 over a tokenizer that has the chat tokens.

    ``render(messages)`` -> ids; ``render_for_training(messages)`` -> (ids, loss_mask);
    ``render_chat(messages)`` -> :class:`RenderedChat` (ids, mask, images); ``parser()`` -> a
    streaming ``ChatParser`` of the same format. ``image_proc`` (the model's image preprocessing)
    allows images: without it an image part is refused, naming it.
    """

    def __init__(self, tokenizer: Tokenizer, image_proc: ImageProcConfig | None = None, *,
                 max_image_pixels: int = MAX_IMAGE_PIXELS):
        if tokenizer.chat_token_ids is None:
            raise K3Error("tokenizer has no chat tokens (missing "
                          f"{', '.join(tokenizer.missing_chat_tokens)}): it was trained by an older "
                          "k3; retrain it (a new run does) to render chats")
        if image_proc is not None and tokenizer.media_token_ids is None:
            raise K3Error("tokenizer has no media tokens (<|media_begin|>, <|media_content|>, "
                          "<|media_end|>, <|media_pad|>): it was trained by k3 before vision; "
                          "retrain it to render images")
        self.tok = tokenizer
        self.ids = dict(tokenizer.chat_token_ids)
        self.media_ids = dict(tokenizer.media_token_ids or {})
        self.image_proc = image_proc
        self.max_image_pixels = max_image_pixels
        self.end_id = self.ids["<|im_end|>"]
        self.think_end_id = self.ids["</think>"]

    # ------------------------------------------------------------------------------ public
    def render(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
               reasoning_effort: str | None = None, add_generation_prompt: bool = True,
               allow_missing_reasoning: bool = False) -> list[int]:
        """Token ids of the conversation, ending with the generation prompt unless told not to."""
        return self._text_only(self.render_chat(
            messages, tools=tools, reasoning_effort=reasoning_effort,
            add_generation_prompt=add_generation_prompt,
            allow_missing_reasoning=allow_missing_reasoning)).ids

    def render_for_training(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
                            reasoning_effort: str | None = None,
                            allow_missing_reasoning: bool = False) -> tuple[list[int], list[int]]:
        """(ids, loss_mask): mask 1 exactly on assistant bodies after ``<think>`` (reasoning,
        ``</think>``, content, the tool-call section) and their closing ``<|im_end|>``."""
        r = self._text_only(self.render_chat(messages, tools=tools, reasoning_effort=reasoning_effort,
                                             add_generation_prompt=False,
                                             allow_missing_reasoning=allow_missing_reasoning))
        return r.ids, r.mask

    def render_chat(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
                    reasoning_effort: str | None = None, add_generation_prompt: bool = True,
                    allow_missing_reasoning: bool = False,
                    base_dir: str | os.PathLike | None = None) -> RenderedChat:
        """Ids, loss mask (as ``render_for_training``'s) and the chat's images in prompt order, each
        decoded (a bad image is a K3Error naming its part). ``base_dir``: where relative image
        paths lie (a JSONL file's folder)."""
        images = _Images(base_dir)
        ids, mask = self._render(messages, tools, reasoning_effort, add_generation_prompt,
                                 allow_missing_reasoning, images)
        return RenderedChat(ids, mask, images.items)

    @staticmethod
    def _text_only(r: RenderedChat) -> RenderedChat:
        if r.images:
            raise K3Error(f"{r.images[0].where} is an image: render this chat with render_chat, "
                          "which returns its images for the vision tower")
        return r

    def generation_prompt(self) -> list[int]:
        return [self.ids["<|im_assistant|>"], *self.tok.encode("assistant"),
                self.ids["<|im_middle|>"], self.ids["<think>"]]

    def media_block(self, size: tuple[int, int], num_tokens: int) -> list[int]:
        """``<|media_begin|>image {W}x{H}<|media_content|>`` + N × ``<|media_pad|>`` + ``<|media_end|>``."""
        m = self.media_ids
        return [m["<|media_begin|>"], *self.tok.encode(f"image {size[0]}x{size[1]}"),
                m["<|media_content|>"], *[m["<|media_pad|>"]] * num_tokens, m["<|media_end|>"]]

    @property
    def media_pad_id(self) -> int | None:
        return self.media_ids.get("<|media_pad|>")

    def parser(self, in_reasoning: bool = True):
        """A streaming parser for one generated assistant message (after the generation prompt)."""
        return ChatParser(self, in_reasoning=in_reasoning)

    def parse(self, ids: Sequence[int], finish_reason: str | None = None):
        """Parse a whole generated message at once (see ``ChatParser.finish``)."""
        p = self.parser()
        for i in ids:
            p.feed(i)
        return p.finish(finish_reason)

    # ----------------------------------------------------------------------------- render
    def _render(self, messages, tools, effort, add_generation_prompt, allow_missing_reasoning,
                images: "_Images"):
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise K3Error(f"messages must be a list of message objects, got {type(messages).__name__}")
        if effort is not None and effort not in EFFORTS:
            raise K3Error(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
        ids: list[int] = []
        mask: list[int] = []
        msgs = list(messages)
        system_extra = self._system_extra(tools, effort)
        if system_extra and not (msgs and isinstance(msgs[0], Mapping) and msgs[0].get("role") == "system"):
            self._turn(ids, mask, "system", "system", [system_extra])
        calls_seen = _Calls()
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            role = self._check_keys(m, where)
            if role == "assistant":
                self._assistant(ids, mask, m, where, calls_seen, allow_missing_reasoning)
            elif role == "tool":
                self._tool_result(ids, mask, m, where, calls_seen, images)
            elif role == "user":
                self._turn(ids, mask, role, role, _content(m.get("content"), f"{where}.content", images=True),
                           images)
            else:
                body = _text(m.get("content"), f"{where}.content")
                self._turn(ids, mask, role, role, [body, system_extra] if i == 0 else [body])
        if add_generation_prompt:
            gen = self.generation_prompt()
            ids += gen
            mask += [0] * len(gen)
        return ids, mask

    def _system_extra(self, tools, effort) -> str:
        parts = []
        if tools:
            if not isinstance(tools, Sequence):
                raise K3Error(f"tools must be a list, got {type(tools).__name__}")
            lines = [canonical_json(self._tool_spec(t, f"tools[{j}]")) for j, t in enumerate(tools)]
            parts.append("# Tools\n" + "\n".join(lines))
        if effort is not None:
            parts.append(f"# Reasoning effort: {effort}")
        return "\n\n".join(parts)

    @staticmethod
    def _tool_spec(t: Any, where: str) -> dict:
        if not isinstance(t, Mapping) or t.get("type", "function") != "function":
            raise K3Error(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        fn = t.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or not TOOL_NAME.fullmatch(fn["name"]):
            raise K3Error(f"{where}.function.name must be 1-64 characters of [A-Za-z0-9_.-]")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise K3Error(f"{where}.function has unknown fields {sorted(unknown)}")
        try:
            canonical_json(dict(fn)).encode("utf-8")
        except (TypeError, ValueError) as e:  # e.g. a set, or a lone surrogate
            raise K3Error(f"{where}.function is not JSON text ({e})") from None
        return dict(fn)

    def _check_keys(self, m: Any, where: str) -> str:
        if not isinstance(m, Mapping):
            raise K3Error(f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLE_KEYS:
            raise K3Error(f"{where}.role must be one of {', '.join(_ROLE_KEYS)}, got {role!r}")
        for k, v in m.items():
            if k != "role" and k not in _ROLE_KEYS[role] and not (k in _EMPTY_OK and not v):
                raise K3Error(f"{where}.{k} is not supported on a {role} message")
        return role

    def _turn(self, ids, mask, marker_role: str, name: str, pieces: Sequence, images=None) -> None:
        """One message. ``pieces``: text pieces joined by a blank line (a system body and its
        extra), or a user / tool body's segments (text runs and image references, in order)."""
        if any(isinstance(p, _ImageRef) for p in pieces):
            body = []
            for p in pieces:
                body += self._image(p, images) if isinstance(p, _ImageRef) else self.tok.encode(p)
        else:
            body = self.tok.encode("\n\n".join(p for p in pieces if p))
        head = [self.ids[f"<|im_{marker_role}|>"], *self.tok.encode(name), self.ids["<|im_middle|>"]]
        seg = head + body + [self.end_id]
        ids += seg
        mask += [0] * len(seg)

    def _image(self, ref: _ImageRef, images: "_Images") -> list[int]:
        """Open one image part, record it, and return its media block."""
        if self.image_proc is None:
            raise K3Error(f"{ref.where} is an image, but this model has no vision tower "
                          "(a text-only model reads text parts only)")
        try:
            im = open_image(ref.url, max_pixels=self.max_image_pixels, base_dir=images.base_dir)
        except K3Error as e:
            raise K3Error(f"{ref.where}: {e}") from None
        n = self.image_proc.num_tokens(*im.size)
        images.items.append(ChatImage(ref.where, ref.url, im.size, n, im))
        return self.media_block(im.size, n)

    def _tool_result(self, ids, mask, m, where, calls_seen, images) -> None:
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise K3Error(f"{where}.tool_call_id is required on a tool message (a str)")
        if cid not in calls_seen.rendered:
            raise K3Error(f"{where}.tool_call_id {cid!r} matches no earlier assistant tool call")
        rid = calls_seen.rendered[cid]
        name = m.get("name")
        if name is not None and name != calls_seen.names[rid]:
            raise K3Error(f"{where}.name {name!r} is not the function of call {cid!r} "
                          f"({calls_seen.names[rid]!r})")
        segs = _content(m.get("content"), f"{where}.content", images=True)
        if isinstance(segs[0], str):
            segs[0] = f"Result of {rid}\n" + segs[0]
        else:
            segs.insert(0, f"Result of {rid}\n")
        self._turn(ids, mask, "system", "tool", segs, images)

    def _assistant(self, ids, mask, m, where, calls_seen, allow_missing_reasoning) -> None:
        calls = m.get("tool_calls") or []
        reasoning = _reasoning(m, where)
        if calls and reasoning is None and not allow_missing_reasoning:
            raise K3Error(f"{where}: an assistant message with tool_calls must carry its reasoning "
                          "(reasoning_content or reasoning) so the history renders as generated; "
                          "allow_missing_reasoning=True renders it with empty thinking")
        head = self.generation_prompt()
        body = [*self.tok.encode(reasoning or ""), self.think_end_id,
                *self.tok.encode(_text(m.get("content"), f"{where}.content", optional=True))]
        if calls:
            body += self._tool_calls(calls, where, calls_seen)
        body.append(self.end_id)
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise K3Error(f"{where}.weight must be 0 or 1 (0: rendered, never trained), got {weight!r}")
        ids += head + body
        mask += [0] * len(head) + [weight] * len(body)

    def _tool_calls(self, calls, where, calls_seen) -> list[int]:
        if not isinstance(calls, list):
            raise K3Error(f"{where}.tool_calls must be a list")
        out = [self.ids["<|tool_calls_section_begin|>"]]
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or c.get("type", "function") != "function":
                raise K3Error(f"{w} must be {{'type': 'function', 'function': {{name, arguments}}}}")
            name, args = fn.get("name"), fn.get("arguments")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise K3Error(f"{w}.function.name must be 1-64 characters of [A-Za-z0-9_.-]")
            if not isinstance(args, str):
                raise K3Error(f"{w}.function.arguments must be a JSON string, got {type(args).__name__}")
            try:
                ok = isinstance(json.loads(args), dict) and bool(args.encode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
                ok = False
            if not ok:
                raise K3Error(f"{w}.function.arguments is not a JSON object: {args[:80]!r}")
            rid = self._call_id(c.get("id"), name, calls_seen.count, w)
            calls_seen.add(c.get("id"), rid, name)
            out += [self.ids["<|tool_call_begin|>"], *self.tok.encode(rid),
                    self.ids["<|tool_call_argument_begin|>"], *self.tok.encode(args),
                    self.ids["<|tool_call_end|>"]]
        out.append(self.ids["<|tool_calls_section_end|>"])
        return out

    @staticmethod
    def _call_id(cid: Any, name: str, index: int, where: str) -> str:
        """An id already of the form functions.{name}:{n} is kept (it is what the model wrote);
        any other id (another provider's) renders as functions.{name}:{index in the conversation}."""
        if cid is not None and not isinstance(cid, str):
            raise K3Error(f"{where}.id must be a str, got {type(cid).__name__}")
        hit = TOOL_CALL_ID.fullmatch(cid) if cid else None
        return cid if hit and hit.group(1) == name else f"functions.{name}:{index}"
