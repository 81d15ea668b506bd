// mesh-llm console: renders the node's status object (pushed over SSE) and chats through the console server.
"use strict";
const $ = (id) => document.getElementById(id);
const gb = (b) => (b / 1e9).toFixed(1) + " GB";

function segment(p, plan) {
  const d = document.createElement("div");
  const inPlan = plan && plan.assignments && plan.assignments.some((a) => a.node === p.node);
  const kind = p.role === "client" ? "client" : p.role === "host" ? "host" : inPlan ? "worker" : "standby";
  d.className = "seg " + kind;
  d.dataset.node = p.short;
  d.style.flex = String(Math.max(p.capacity || 0, 2e8));
  const layers = p.layers ? `layers ${p.layers[0]}–${p.layers[1]}` : kind === "client" ? "lite client" : "standby";
  const path = (p.path === "self" ? "this node" : p.path) + (p.rpc_path ? `; RPC ${p.rpc_path}` : "");
  const rtt = p.rtt_ms != null ? ` · ${p.rtt_ms.toFixed(1)} ms` : "";
  d.innerHTML = `<div class="id"></div><div class="sub"></div><div class="sub"></div>`;
  d.children[0].textContent = `${p.short} · ${kind}`;
  const dev = p.device && p.capacity ? ` (${p.device})` : "";
  d.children[1].textContent = `${layers} · ${p.capacity ? gb(p.capacity) : "no capacity"}${dev}`;
  d.children[2].textContent = `${path}${rtt}`;
  return d;
}

function render(st) {
  $("mesh").textContent = `node ${st.node.slice(0, 8)} in mesh ${st.mesh.slice(0, 8)}`;
  const cluster = $("cluster");
  cluster.replaceChildren(...st.peers.map((p) => segment(p, st.plan)));
  const plan = st.plan || {};
  $("m-name").textContent = st.model ? st.model.source : (st.served_models || []).join(", ") || "–";
  $("m-draft").textContent = st.draft || "none";
  $("m-state").textContent = plan.waiting ? plan.waiting : st.state;
  $("m-cap").textContent = gb(st.peers.reduce((s, p) => s + (p.capacity || 0), 0));
  $("m-api").textContent = st.api;
  $("m-req").textContent = JSON.stringify(st.requests);
  const agents = $("agents");
  agents.replaceChildren();
  (st.agents || []).forEach((a, i) => {
    const label = document.createElement("div");
    label.className = "sub";
    label.textContent = a.label;
    const pre = document.createElement("pre");  // exactly what runs: the copy button copies this, no label
    pre.id = "agent-" + i;
    pre.textContent = a.copy;
    const b = document.createElement("button");
    b.textContent = "copy";
    b.dataset.copy = pre.id;
    agents.append(label, pre, b);
  });
}

function connect() {
  const es = new EventSource("/events");
  es.onopen = () => { $("conn").textContent = "live"; };
  es.onmessage = (ev) => render(JSON.parse(ev.data));
  es.onerror = () => { $("conn").textContent = "reconnecting…"; };
}

document.addEventListener("click", async (ev) => {
  const id = ev.target.dataset && ev.target.dataset.copy;
  if (id) {
    try { await navigator.clipboard.writeText($(id).textContent); ev.target.textContent = "copied"; }
    catch (e) { ev.target.textContent = "select and copy"; }
  }
});

$("show-token").onclick = async () => {
  const r = await fetch("/token");
  $("token").textContent = r.ok ? (await r.json()).token : "no token";
  $("token-box").hidden = false;
};

$("chat-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  const log = $("chat-log");
  const u = document.createElement("div"); u.className = "msg user"; u.textContent = text;
  const a = document.createElement("div"); a.className = "msg assistant"; a.dataset.testid = "reply";
  log.append(u, a);
  const t0 = performance.now();
  let n = 0;
  const r = await fetch("/chat", { method: "POST", headers: { "Content-Type": "application/json" },
                                   body: JSON.stringify({ messages: [{ role: "user", content: text }] }) });
  if (!r.ok || !r.body) { a.textContent = "error: " + r.status; return; }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim(); buf = buf.slice(i + 1);
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const ev = JSON.parse(line.slice(6));
      const piece = ev.choices && ev.choices[0] && ev.choices[0].delta && ev.choices[0].delta.content;
      if (piece) { a.textContent += piece; n += 1; }
      if (ev.error) a.textContent += " [" + ev.error.message + "]";
    }
    $("chat-stats").textContent = `${n} tokens, ${(n / ((performance.now() - t0) / 1000)).toFixed(1)} tok/s`;
  }
  a.dataset.done = "1";
};

connect();
