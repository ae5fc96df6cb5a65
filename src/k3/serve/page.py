"""The chat page served at ``GET /``: one self-contained HTML file (inline CSS and JS, nothing
fetched from elsewhere). It streams ``/v1/chat/completions``, shows the thinking in a collapsible section and
the answer below it, has an effort selector (low / high / max) and a temperature field, and sends each earlier reply back
with its ``reasoning_content`` (preserved thinking). Images chosen in the file input (``#image``) go with the
message as OpenAI content parts: one ``image_url`` part (a ``data:`` URL read by FileReader) per file, in order,
then the text part; the history keeps those parts, so later turns send the images again. A message with no
image is sent as plain string content, as before."""

from __future__ import annotations

__all__ = ["chat_page"]

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>k3 chat</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:system-ui,sans-serif;max-width:52rem;margin:0 auto;padding:1rem;background:#fafafa}
#log .turn{margin:.6rem 0;padding:.6rem .8rem;border-radius:.5rem;white-space:pre-wrap}
.user{background:#e6f0ff}.assistant{background:#fff;border:1px solid #ddd}
details.thinking{color:#666;font-size:.9em;margin-bottom:.4rem}
details.thinking summary{cursor:pointer}
form{display:flex;gap:.5rem;align-items:flex-end}textarea{flex:1;min-height:3rem}
.err{color:#b00}
.turn img{max-height:8rem;margin:0 .3rem .3rem 0;vertical-align:top}
</style></head><body>
<h1>k3 chat <small id="model"></small></h1>
<div id="log"></div>
<form id="f">
<textarea id="prompt" placeholder="Message"></textarea>
<label>images <input id="image" type="file" accept="image/png,image/jpeg,image/webp,image/gif,image/bmp" multiple></label>
<label>effort <select id="effort"><option>low</option><option>high</option><option selected>max</option></select></label>
<label>temperature <input id="temp" type="number" value="0.7" step="0.1" min="0" max="2"></label>
<input id="key" type="password" placeholder="API key (optional)" size="12">
<button id="send" type="submit">Send</button>
</form>
<script>
const history = [];
const log = document.getElementById("log");
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }
function headers() { const h = {"Content-Type": "application/json"};
  const k = document.getElementById("key").value; if (k) h["Authorization"] = "Bearer " + k; return h; }
function readUrl(file) { return new Promise((ok, fail) => { const r = new FileReader();
  r.onload = () => ok(r.result); r.onerror = () => fail(r.error || new Error("cannot read " + file.name));
  r.readAsDataURL(file); }); }
fetch("/v1/models", {headers: headers()}).then(r => r.json()).then(j => {
  if (j.data) document.getElementById("model").textContent = j.data[0].id; });
document.getElementById("f").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const box = document.getElementById("prompt"); const text = box.value.trim();
  const pick = document.getElementById("image"); const files = pick && pick.files ? [...pick.files] : [];
  if (!text && !files.length) return;
  box.value = ""; if (files.length) pick.value = "";
  let content = text;
  if (files.length) {
    let urls;
    try { urls = await Promise.all(files.map(readUrl)); }
    catch (e) { log.appendChild(el("div", "turn user err", "error: " + (e && e.message || e))); return; }
    const user = el("div", "turn user");
    content = urls.map(url => ({type: "image_url", image_url: {url}}));
    for (let i = 0; i < urls.length; i++) { const img = el("img"); img.src = urls[i]; img.alt = files[i].name;
      user.appendChild(img); }
    if (text) { content.push({type: "text", text}); user.appendChild(el("div", "", text)); }
    log.appendChild(user);
  } else log.appendChild(el("div", "turn user", text));
  history.push({role: "user", content});
  const turn = el("div", "turn assistant"); const det = el("details", "thinking"); det.open = true;
  det.appendChild(el("summary", "", "Thinking")); const thinking = el("div", "thinking-text"); det.appendChild(thinking);
  const answer = el("div", "answer"); turn.appendChild(det); turn.appendChild(answer); log.appendChild(turn);
  const msg = {role: "assistant", content: "", reasoning_content: ""};
  const body = {model: document.getElementById("model").textContent, messages: history, stream: true,
                reasoning_effort: document.getElementById("effort").value,
                temperature: parseFloat(document.getElementById("temp").value)};
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body)});
    if (!r.ok) { const j = await r.json(); throw new Error(j.error ? j.error.message : r.statusText); }
    const reader = r.body.getReader(); const dec = new TextDecoder(); let buf = "";
    for (;;) {
      const {value, done} = await reader.read(); if (done) break;
      buf += dec.decode(value, {stream: true}); let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const j = JSON.parse(line.slice(6));
        if (j.error) throw new Error(j.error.message);
        if (!j.choices || !j.choices.length) continue;
        const d = j.choices[0].delta;
        if (d.reasoning_content) {
          msg.reasoning_content += d.reasoning_content; thinking.textContent = msg.reasoning_content; }
        if (d.content) {
          if (det.open && !msg.content) det.open = false;  // fold the thinking once the answer starts
          msg.content += d.content; answer.textContent = msg.content; }
        if (d.tool_calls) { msg.tool_calls = (msg.tool_calls || []).concat(d.tool_calls);
          answer.textContent = msg.content + "\n[tool calls: " + JSON.stringify(msg.tool_calls) + "]"; }
      }
    }
    history.push(msg); turn.dataset.done = "1";
  } catch (e) { answer.appendChild(el("div", "err", "error: " + e.message)); history.pop(); turn.dataset.done = "1"; }
});
</script></body></html>
"""


def chat_page() -> str:
    return _PAGE
