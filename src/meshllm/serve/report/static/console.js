// mesh-llm console: renders the node's status object (pushed over SSE) and chats through the console server.
"use strict";
const $ = (id) => document.getElementById(id);

// [face-3] 4: 24-hour times, whatever the browser's locale would pick (a timeline of "9:41:07 PM" reads badly)
function clock(d) {
  return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false });
}

const gb = (b) => (b / 1e9).toFixed(1) + " GB";

// where a node stands, as every node computes it (proto/standing.py): "serving", "loading: 43%", "standby: ..."
const stateText = (state, why) => (!why ? state : why.split(" ")[0] === state.split(" ")[0] ? why : `${state}: ${why}`);

function segment(p, models) {
  const d = document.createElement("div");
  // the colour says what it does: host (a replica too: it serves the whole model), worker of the running plan,
  // standby (not in it), lite client
  const kind = p.label === "replica" ? "host" : p.label;  // [face-3] 4: one word per node, the mesh's (status.py)
  const suspect = p.liveness === "suspect" || p.state === "unreachable";  // silent: maybe gone (dead at 10 s)
  d.className = "seg " + kind + (suspect ? " suspect" : "");
  d.dataset.node = p.short;
  d.title = `node ${p.node}`;
  // [face-3] 4: wider for more memory, never narrower than its name (CSS min-width); the row wraps instead
  d.style.flexGrow = String(Math.max(p.capacity || 0, 2e8) / 1e9);
  // [face-3] 4: a host's share always has the output layer ("no layers" for a host holding only the output misled)
  const out = kind === "host" ? " + output" : "";
  const layers = p.layers ? `layers ${p.layers[0]}–${p.layers[1]}${out}` : out ? "output" : kind === "client" ? "lite client"
    : "no layers";
  const path = (p.path === "self" ? "this node" : p.path) + (p.rpc_path ? `; RPC ${p.rpc_path}` : "");
  const rtt = p.rtt_ms != null ? ` · ${p.rtt_ms.toFixed(1)} ms` : "";
  d.innerHTML = `<div class="id"></div><div class="sub state"></div><div class="sub"></div><div class="sub"></div>`;
  // several models in the mesh: each node says which one it holds
  const model = models.length > 1 && p.model ? (models.find((m) => m.fingerprint === p.model) || {}).name : "";
  d.children[0].textContent = `${p.name || p.short} · ${p.label}` + (model ? ` · ${model}` : "");
  d.children[1].textContent = stateText(p.state, p.why);
  const dev = p.device && p.capacity ? ` (${p.device})` : "";
  const used = p.planned_bytes ? `${gb(p.planned_bytes)} of ` : "";  // what the plan puts there, of what it offers
  const scope = p.scope && p.scope !== "host" ? ` · ${p.scope} scope` : "";
  // [big] RAM beside it: what the plan keeps there (experts, whole layers) of what the node offers
  const ram = p.ram && p.capacity ? ` + ${p.planned_ram_bytes ? gb(p.planned_ram_bytes) + " of " : ""}${gb(p.ram)} RAM` : "";
  d.children[2].textContent = `${layers} · ${p.capacity ? used + gb(p.capacity) : "no capacity"}${dev}${ram}${scope}`;
  d.children[3].textContent = `${path}${rtt}`;
  return d;
}

function render(st) {
  $("mesh").textContent = `node ${st.node.slice(0, 8)} in mesh ${st.mesh.slice(0, 8)}`;
  const cluster = $("cluster");
  // a stable order: the host first, then by node id (a rejoin must not reshuffle the bar)
  const rank = (p) => (p.label === "host" ? "0" : p.label === "replica" ? "1" : "2") + p.node;
  const peers = [...st.peers].sort((x, y) => (rank(x) < rank(y) ? -1 : 1));
  const models = st.models || [];
  cluster.replaceChildren(...peers.map((p) => segment(p, models)));
  $("m-name").textContent = st.model ? st.model.source : (st.served_models || []).join(", ") || "–";
  // every model the mesh serves: its host (each model has its own election) and the nodes that hold it
  // and its replicas: hosts of it beside the elected one, each serving the whole model
  const reps = (m) => (m.replicas || []).length ? ` · replicas ${m.replicas.map((n) => n.slice(0, 8)).join(", ")}` : "";
  // [face-3] 1: each model's own tokens and slots (its hosts', summed), never another model's as the mesh's
  const figs = (m) => m.tokens && m.slots ? ` · ${m.tokens.generated} tokens, ${m.tokens.rate} tok/s · slots ` +
    `${m.slots.busy} of ${m.slots.total} busy` : "";
  $("m-models").textContent = models.map((m) => `${m.name}: host ${m.host ? m.host.slice(0, 8) : "none"} ` +
    `${m.state}${reps(m)} · nodes ${m.nodes.map((n) => n.slice(0, 8)).join(", ")}${figs(m)}`).join("  |  ") || "–";
  $("m-draft").textContent = st.draft || "none";
  $("m-state").textContent = st.unavailable || stateText(st.state, st.why);  // what /health says
  const f = st.fetch;  // this node fetching its model from the members that have it
  if (f) $("m-state").textContent = `fetching ${f.name} from ${f.sources} peer${f.sources === 1 ? "" : "s"}: ${f.percent}%, ${f.mb_per_s} MB/s`;
  $("m-cap").textContent = gb(st.peers.reduce((s, p) => s + (p.capacity || 0), 0));
  $("m-api").textContent = st.api;
  const req = Object.entries(st.requests || {}).map(([code, n]) => `${n} × ${code}`);
  $("m-req").textContent = req.length ? req.join(", ") : "none yet";
  $("m-flight").textContent = `${st.in_flight || 0} request${st.in_flight === 1 ? "" : "s"}` +
    (st.last_tokens_per_second ? ` · last reply ${st.last_tokens_per_second.toFixed(1)} tok/s (llama-server's timing)` : "");
  const mt = st.mesh_tokens;
  $("m-tps").textContent = mt
    ? `${mt.rate.toFixed(1)} tok/s now · ${mt.generated} tokens generated, ${mt.prompt} prompt tokens` +
      (mt.host ? ` (host ${mt.host})` : "") : "–";
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

function timeline(events) {
  const list = $("timeline");
  list.replaceChildren(...events.slice().reverse().map((e) => {
    const li = document.createElement("li");
    li.className = e.kind;
    const t = document.createElement("time");
    t.textContent = clock(new Date(e.t * 1000));
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
    $("conn").textContent = `lost contact at ${clock(lostAt)}: what is shown is from then; reconnecting…`;
  };
}

document.addEventListener("click", async (ev) => {
  const id = ev.target.dataset && ev.target.dataset.copy;
  if (id) {
    try { await navigator.clipboard.writeText($(id).textContent); ev.target.textContent = "copied"; }
    catch (e) { ev.target.textContent = "select and copy"; }
  }
});

// nodes that found the mesh on the LAN and knocked (mesh-llm --join-lan): each approved with a scope, or left out
let lastKnocks = "";
async function showKnocks() {
  let rows = [];
  try { const r = await fetch("/knocks"); if (r.ok) rows = (await r.json()).knocks; } catch (e) { return; }
  const seen = JSON.stringify(rows.map((k) => k.node));
  if (seen === lastKnocks) return;  // the same nodes: keep the scopes being chosen
  lastKnocks = seen;
  const ul = $("knocks");
  ul.replaceChildren();
  if (!rows.length) { const li = document.createElement("li"); li.textContent = "nobody"; ul.append(li); return; }
  for (const k of rows) {
    const li = document.createElement("li");
    li.textContent = `${k.node.slice(0, 8)} "${k.name}" from ${k.addr} `;
    const scope = document.createElement("select");
    for (const s of ["worker", "host", "client"]) { const o = document.createElement("option"); o.textContent = s; scope.append(o); }
    const act = (what) => {
      const b = document.createElement("button");
      b.textContent = what; b.dataset.node = k.node;
      b.onclick = async () => {
        const r = await fetch("/" + what, {method: "POST", headers: {"Content-Type": "application/json"},
          body: JSON.stringify({node: k.node, scope: scope.value})});
        const got = await r.json();
        li.textContent = got.said || got.error;
      };
      return b;
    };
    li.append(scope, act("approve"), act("refuse"));
    ul.append(li);
  }
}
showKnocks();
setInterval(showKnocks, 3000);

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
