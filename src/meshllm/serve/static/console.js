// mesh-llm console: renders the node's status object (pushed over SSE) and chats through the console server.
"use strict";
const $ = (id) => document.getElementById(id);
const gb = (b) => (b / 1e9).toFixed(1) + " GB";

function segment(p, plan) {
  const d = document.createElement("div");
  const inPlan = plan && plan.assignments && plan.assignments.some((a) => a.node === p.node);
  const kind = p.role === "client" ? "client" : p.role === "host" ? "host" : inPlan ? "worker" : "standby";
  const suspect = p.liveness === "suspect";  // silent for a few seconds: maybe gone (declared dead at 10 s)
  d.className = "seg " + kind + (suspect ? " suspect" : "");
  d.dataset.node = p.short;
  d.title = `node ${p.node}`;
  d.style.flex = String(Math.max(p.capacity || 0, 2e8));
  const layers = p.layers ? `layers ${p.layers[0]}–${p.layers[1]}` : kind === "client" ? "lite client" : "standby";
  const path = (p.path === "self" ? "this node" : p.path) + (p.rpc_path ? `; RPC ${p.rpc_path}` : "");
  const rtt = p.rtt_ms != null ? ` · ${p.rtt_ms.toFixed(1)} ms` : "";
  d.innerHTML = `<div class="id"></div><div class="sub"></div><div class="sub"></div>`;
  d.children[0].textContent = `${p.name || p.short} · ${kind}${suspect ? " · not heard from" : ""}`;
  const dev = p.device && p.capacity ? ` (${p.device})` : "";
  const used = p.planned_bytes ? `${gb(p.planned_bytes)} of ` : "";  // what the plan puts there, of what it offers
  const scope = p.scope && p.scope !== "host" ? ` · ${p.scope} scope` : "";
  d.children[1].textContent = `${layers} · ${p.capacity ? used + gb(p.capacity) : "no capacity"}${dev}${scope}`;
  d.children[2].textContent = `${path}${rtt}`;
  return d;
}

function render(st) {
  $("mesh").textContent = `node ${st.node.slice(0, 8)} in mesh ${st.mesh.slice(0, 8)}`;
  const cluster = $("cluster");
  // a stable order: the host first, then by node id (a rejoin must not reshuffle the bar)
  const rank = (p) => (p.role === "host" ? "0" : "1") + p.node;
  const peers = [...st.peers].sort((x, y) => (rank(x) < rank(y) ? -1 : 1));
  cluster.replaceChildren(...peers.map((p) => segment(p, st.plan)));
  const plan = st.plan || {};
  $("m-name").textContent = st.model ? st.model.source : (st.served_models || []).join(", ") || "–";
  $("m-draft").textContent = st.draft || "none";
  $("m-state").textContent = st.unavailable || (plan.waiting ? plan.waiting : st.state);  // what /health says
  $("m-cap").textContent = gb(st.peers.reduce((s, p) => s + (p.capacity || 0), 0));
  $("m-api").textContent = st.api;
  const req = Object.entries(st.requests || {}).map(([code, n]) => `${n} × ${code}`);
  $("m-req").textContent = req.length ? req.join(", ") : "none yet";
  const mt = st.mesh_tokens;
  if (mt && mt.progress >= 0) $("m-state").textContent = `loading the model: ${mt.progress}%`;
  $("m-tps").textContent = meshRate(mt);
  const tt = st.ttft_s;
  const mtt = st.mesh_ttft_s;
  const here = tt ? `this node: ${(tt.last * 1000).toFixed(0)} ms last, ≤ ${(tt.p50 * 1000).toFixed(0)} ms median` : "";
  const mesh = mtt ? `mesh: ${(mtt.avg * 1000).toFixed(0)} ms average over ${mtt.count} requests` : "";
  $("m-ttft").textContent = [mesh, here].filter(Boolean).join(" · ") || "–";
  const sl = st.slots || {};
  $("m-slots").textContent = sl.total
    ? `${sl.busy} of ${sl.total} busy, ${sl.queued} waiting · ${sl.ctx} tokens each` : "–";
  timeline(st.events || []);
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

// the whole mesh's tokens per second: the host's own count (every completion runs there), between two updates
let lastCount = null;
function meshRate(mt) {
  if (!mt) return "–";
  const now = Date.now() / 1000;
  let rate = "";
  if (lastCount && lastCount.host === mt.host && mt.generated >= lastCount.n && now - lastCount.t >= 1) {
    rate = `${((mt.generated - lastCount.n) / (now - lastCount.t)).toFixed(1)} tok/s now · `;
  }
  if (!lastCount || lastCount.host !== mt.host || now - lastCount.t >= 5) lastCount = { host: mt.host, n: mt.generated, t: now };
  return `${rate}${mt.generated} tokens generated, ${mt.prompt} prompt tokens (host ${mt.host})`;
}

function timeline(events) {
  const list = $("timeline");
  list.replaceChildren(...events.slice().reverse().map((e) => {
    const li = document.createElement("li");
    li.className = e.kind;
    const t = document.createElement("time");
    t.textContent = new Date(e.t * 1000).toLocaleTimeString();
    li.append(t, document.createTextNode(e.text));
    return li;
  }));
}

let lostAt = null;  // when this page lost its node (the node died, or stopped): everything shown is stale from then

function connect() {
  const es = new EventSource("/events");
  es.onopen = () => { lostAt = null; document.body.classList.remove("lost"); $("conn").textContent = "live"; };
  es.onmessage = (ev) => render(JSON.parse(ev.data));
  es.onerror = () => {  // the browser retries by itself; until then the page says it is out of date, and since when
    lostAt = lostAt || new Date();
    document.body.classList.add("lost");
    $("conn").textContent = `lost contact at ${lostAt.toLocaleTimeString()}: what is shown is from then; reconnecting…`;
  };
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

// the chat keeps the conversation (every turn goes back to the model), streams, and can be stopped
let history = [];
let running = null;  // the AbortController of the reply that streams now

function say(cls, text) {
  const d = document.createElement("div"); d.className = "msg " + cls; d.textContent = text;
  $("chat-log").append(d);
  return d;
}

function follow() { const log = $("chat-log"); log.scrollTop = log.scrollHeight; }

function busy(on) {
  $("chat-send").disabled = on; $("chat-stop").hidden = !on; $("chat-input").disabled = on;
  if (!on) $("chat-input").focus();
}

$("chat-stop").onclick = () => { if (running) running.abort(); };
$("chat-clear").onclick = () => { if (running) running.abort(); history = []; $("chat-log").textContent = ""; };

$("chat-form").onsubmit = async (ev) => {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || running) return;
  $("chat-input").value = "";
  say("user", text);
  const a = say("assistant", ""); a.dataset.testid = "reply";
  history.push({ role: "user", content: text });
  const system = $("chat-system").value.trim();
  const body = {
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    temperature: Number($("chat-temp").value), max_tokens: Number($("chat-max").value),
  };
  running = new AbortController();
  busy(true);
  const t0 = performance.now();
  let n = 0, first = null, stopped = false;
  try {
    const r = await fetch("/chat", { method: "POST", headers: { "Content-Type": "application/json" },
                                     body: JSON.stringify(body), signal: running.signal });
    if (!r.ok || !r.body) {
      let why = "";
      try { const j = await r.json(); why = (j.error && (j.error.message || j.error)) || ""; } catch (e) { /* not JSON */ }
      a.className = "msg assistant error"; a.textContent = `error ${r.status}${why ? ": " + why : ""}`;
      history.pop();
      return;
    }
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
        if (piece) { a.textContent += piece; n += 1; if (first === null) first = performance.now() - t0; }
        if (ev.error) { a.className = "msg assistant error"; a.textContent += " [" + ev.error.message + "]"; }
      }
      const secs = (performance.now() - t0) / 1000;
      $("chat-stats").textContent = `${n} tokens, ${(n / secs).toFixed(1)} tok/s` +
        (first === null ? "" : `, first token after ${(first / 1000).toFixed(2)} s`);
      follow();
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else { a.className = "msg assistant error"; a.textContent += " [" + e.message + "]"; }
  } finally {
    if (a.textContent && !a.classList.contains("error")) history.push({ role: "assistant", content: a.textContent });
    if (stopped) { a.textContent += " [stopped]"; a.dataset.stopped = "1"; }
    a.dataset.done = "1";
    running = null;
    busy(false);
    follow();
  }
};

connect();
