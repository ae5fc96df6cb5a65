// Runs the chat page's own script (fetched from a live `k3 serve`) in node against a minimal DOM:
// types a prompt, submits, waits for the streamed reply, prints what the page shows as JSON.
// Usage: node page_driver.js BASE_URL PROMPT EFFORT TEMPERATURE
const [base, prompt, effort, temperature] = process.argv.slice(2);

class Element {
  constructor(tag) { this.tag = tag; this.children = []; this.className = ""; this.textContent = "";
    this.dataset = {}; this.value = ""; this.open = false; this.listeners = {}; }
  appendChild(c) { this.children.push(c); return c; }
  addEventListener(kind, fn) { this.listeners[kind] = fn; }
}
const byId = {};
for (const id of ["log", "f", "prompt", "effort", "temp", "key", "model", "send"]) byId[id] = new Element(id);
byId.effort.value = "max";
globalThis.document = { getElementById: (id) => byId[id], createElement: (tag) => new Element(tag) };
const realFetch = globalThis.fetch;
globalThis.fetch = (url, opts) => realFetch(new URL(url, base), opts);

function find(node, pred, out = []) {
  if (pred(node)) out.push(node);
  for (const c of node.children) find(c, pred, out);
  return out;
}

(async () => {
  const html = await (await realFetch(base + "/")).text();
  const script = html.slice(html.indexOf("<script>") + 8, html.lastIndexOf("</script>"));
  new Function(script)();
  for (let i = 0; i < 100 && !byId.model.textContent; i++) await new Promise(r => setTimeout(r, 50));
  byId.prompt.value = prompt;
  byId.effort.value = effort;
  byId.temp.value = temperature;
  const done = byId.f.listeners.submit({ preventDefault() {} });
  await done;
  const turn = find(byId.log, n => n.className === "turn assistant")[0];
  const thinking = find(turn, n => n.className === "thinking-text")[0].textContent;
  const answer = find(turn, n => n.className === "answer")[0];
  const errors = find(turn, n => n.className === "err").map(n => n.textContent);
  const details = find(turn, n => n.tag === "details")[0];
  console.log(JSON.stringify({ model: byId.model.textContent, thinking, answer: answer.textContent, errors,
                               done: turn.dataset.done, collapsed: !details.open }));
})().catch(e => { console.error(e); process.exit(1); });
