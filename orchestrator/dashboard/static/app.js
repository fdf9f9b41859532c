// orch dashboard: draws JSON from the API. Every string from a run (a model wrote most of
// them) is set with textContent, never as markup: a description like <img onerror=...>
// shows as text.
"use strict";

const CSRF = document.querySelector('meta[name="orch-csrf"]').content;
const main = document.getElementById("main");
const live = document.getElementById("live");
const banner = document.getElementById("banner");
const AGAIN_MS = 2000; // a page whose store is away asks again this often

// the store away (a server restarting): one line in the banner, as text, until it answers
function storeAway(line) {
  banner.textContent = line;
  banner.hidden = false;
  live.textContent = "store unreachable, retrying";
}

function storeBack() {
  banner.hidden = true;
  banner.textContent = "";
  live.textContent = "live";
}

// a 503 from the API: the store is away; said in the banner, asked again later
async function away(res, again) {
  if (res.status !== 503) return false;
  let line = "store unreachable, retrying";
  try {
    line = `${line} (${(await res.json()).error})`;
  } catch {
    // the line as it is
  }
  storeAway(line);
  setTimeout(again, AGAIN_MS);
  return true;
}

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "href") node.setAttribute("href", v);
    else node.dataset[k] = v;
  }
  for (const kid of kids) {
    if (kid === null || kid === undefined) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  return `${Math.round(s / 3600)}h ago`;
}

function activity(r) {
  const a = r.last_activity;
  return a ? a.summary : "";
}

function show(...kids) {
  main.replaceChildren(...kids.filter((k) => k !== null && k !== undefined));
}

// cost and chain totals come worded by the server (cost_text, chain.text): one format
// everywhere, and the page adds nothing up
const COLUMNS = ["agent", "description", "status", "tier", "node", "tokens", "cost", "chain", "activity"];

function cells(r) {
  const link = el("a", { href: `/run/${encodeURIComponent(r.run_id)}` }, r.run_id);
  const indent = "\u00a0\u00a0".repeat(r.depth || 0);
  return [
    el("td", {}, indent, el("span", {}, r.agent || ""), " ", el("span", { class: "dim" }, link)),
    el("td", { class: "desc" }, r.description || ""),
    el("td", { class: `status status-${r.status}` }, r.status || ""),
    el("td", {}, r.isolation || ""),
    el("td", { class: "dim" }, r.node || ""),
    el("td", { class: "num" }, (r.tokens || 0).toLocaleString("en-US")),
    el("td", { class: "num cost" }, r.cost_text || ""),
    el("td", { class: "dim chain" }, r.chain ? r.chain.text : ""),
    el("td", { class: "dim" }, activity(r), " ", ago(r.last_activity_at)),
  ];
}

// -- the list ------------------------------------------------------------------------------
const rows = new Map();
let table = null;

function drawRow(r) {
  let tr = rows.get(r.run_id);
  const fresh = !tr;
  if (fresh) {
    tr = el("tr", { run: r.run_id });
    rows.set(r.run_id, tr);
  }
  tr.className = r.depth ? "" : "root";
  tr.replaceChildren(...cells(r));
  return [tr, fresh];
}

function placeRow(r, tr) {
  const parent = r.parent_run_id && rows.get(r.parent_run_id);
  if (parent && parent.parentNode === table) {
    let after = parent;
    while (after.nextSibling && (after.nextSibling.dataset.parent || "") !== "" &&
           isBelow(after.nextSibling, r.parent_run_id)) after = after.nextSibling;
    tr.dataset.parent = r.parent_run_id;
    after.after(tr);
  } else {
    table.append(tr);
  }
}

function isBelow(tr, ancestor) {
  let p = tr.dataset.parent;
  while (p) {
    if (p === ancestor) return true;
    const up = rows.get(p);
    p = up ? up.dataset.parent : "";
  }
  return false;
}

async function showList() {
  const res = await fetch("/api/runs");
  if (await away(res, showList)) return;
  storeBack();
  const data = await res.json();
  table = el("tbody");
  for (const r of data.runs) {
    const [tr] = drawRow(r);
    if (r.parent_run_id && rows.has(r.parent_run_id)) tr.dataset.parent = r.parent_run_id;
    table.append(tr);
  }
  const head = el("tr", {}, ...COLUMNS.map((c) => el("th", {}, c)));
  show(
    el("table", {}, el("thead", {}, head), table),
    data.cut ? el("p", { class: "dim" }, "(the latest runs only)") : null,
  );
  follow(data.at, (changed) => {
    for (const r of changed) {
      const [tr, fresh] = drawRow(r);
      if (fresh) placeRow(r, tr);
    }
  });
}

// -- one run -------------------------------------------------------------------------------
function section(title, ...kids) {
  return el("section", {}, el("h2", {}, title), ...kids);
}

function blockText(b) {
  if (typeof b === "string") return b;
  if (b.type === "text") return b.text;
  if (b.type === "tool_use") return `→ ${b.name} ${JSON.stringify(b.input)}`;
  if (b.type === "tool_result") {
    const c = typeof b.content === "string" ? b.content : JSON.stringify(b.content);
    return `← ${c}`;
  }
  return JSON.stringify(b);
}

function conversation(messages) {
  return messages.map((m) => {
    const parts = typeof m.content === "string" ? [m.content] : m.content.map(blockText);
    return el("div", { class: `msg ${m.role}` }, el("strong", {}, m.role), el("pre", {}, parts.join("\n")));
  });
}

function teamSection(team) {
  if (!team) return null;
  if (team.error && !team.plan) return section("Team", el("p", {}, team.error));
  const lines = [];
  for (const g of team.gates || []) {
    lines.push(el("li", {}, `round ${g.round} · candidate ${g.candidate}: ${g.passed ? "gate passed" : "gate failed"} (${g.command})`));
  }
  for (const r of team.reviews || []) {
    for (const n of r.notes) {
      lines.push(el("li", {}, `round ${r.round} · [${n.reviewer}] ${n.verdict.verdict}: ${n.verdict.summary}`));
    }
  }
  const board = team.board ? el("ul", {}, ...team.board.tasks.map((t) =>
    el("li", {}, `${t.id} ${t.state}${t.owner ? " [" + t.owner + "]" : ""}: ${t.title}`))) : null;
  const messages = team.board ? el("ul", {}, ...team.board.messages.map((m) =>
    el("li", {}, `${m.sender} → ${m.to}: ${m.text}`))) : null;
  return section("Team", el("p", {}, `round ${team.rounds} of ${team.max_rounds} · ${team.approved ? "approved" : "not approved"}${team.branch ? " · " + team.branch : ""}`),
    el("ul", {}, ...lines), board ? el("h3", {}, "Board") : null, board,
    messages ? el("h3", {}, "Messages") : null, messages);
}

async function act(runId, what, note) {
  note.textContent = `${what}…`;
  const res = await fetch(`/api/run/${encodeURIComponent(runId)}/${what}`, {
    method: "POST", headers: { "x-orch-csrf": CSRF },
  });
  const data = await res.json();
  note.textContent = res.ok ? `${what}: ${data.status || data.commit || "done"}` : `${what} refused: ${data.error}`;
  await drawRun(runId);
}

async function drawRun(runId) {
  const res = await fetch(`/api/run/${encodeURIComponent(runId)}`);
  if (await away(res, () => drawRun(runId))) return;
  if (!banner.hidden) storeBack();
  if (!res.ok) {
    show(el("p", {}, `no run ${runId}`));
    return;
  }
  const d = await res.json();
  const r = d.run;
  const note = el("span", { class: "dim" });
  note.id = "note";
  const cancel = el("button", {}, "Cancel");
  cancel.id = "cancel";
  cancel.disabled = ["succeeded", "failed", "cancelled", "timed_out", "interrupted"].includes(r.status);
  cancel.addEventListener("click", () => act(runId, "cancel", note));
  const merge = d.diff ? el("button", {}, "Merge") : null;
  if (merge) {
    merge.id = "merge";
    merge.addEventListener("click", () => act(runId, "merge", note));
  }
  const status = el("span", { class: `status status-${r.status}` }, r.status);
  status.id = "status";
  show(
    section(`${r.agent} · ${r.run_id}`,
      el("p", { class: "desc" }, r.description || ""),
      el("p", {}, status, ` · ${r.isolation} · depth ${r.depth} · ${r.model} · node ${r.node || ""}`),
      el("p", {}, cancel, merge, note)),
    usageSection(d.usage, d.children.length > 0, r.depth > 0),
    d.children.length ? section("Children", el("ul", {}, ...d.children.map((c) =>
      el("li", {}, el("a", { href: `/run/${encodeURIComponent(c.run_id)}` }, `${c.agent} ${c.run_id}`), ` ${c.status} · ${c.cost_text}: ${c.description || ""}`)))) : null,
    teamSection(d.team),
    section("Result", el("pre", {}, d.output || r.error || "(none yet)")),
    section("Evidence", el("pre", {}, JSON.stringify(r.evidence, null, 2))),
    d.diff ? section(`Branch ${d.diff.branch}`, el("pre", {}, d.diff.text)) : null,
    networkSection(d.network),
    section("Conversation", ...conversation(d.transcript)),
    section("Events", el("pre", {}, d.events.map((e) => `${new Date(e.at * 1000).toLocaleTimeString()} ${e.kind} ${JSON.stringify(e.data)}`).join("\n"))),
  );
}

function usageSection(u, below, child) {
  if (!u) return null;
  const mine = el("p", {}, u.text);
  mine.id = "usage";
  return section("Usage",
    mine,
    el("p", { class: "dim" }, u.context_text),
    below ? el("p", {}, `with the runs under it: ${u.with_below.text}`) : null,
    child ? el("p", {}, `chain: ${u.chain.text}`) : null);
}

function networkSection(n) {
  if (!n) return null;
  const rows = n.requests.map((q) =>
    el("li", { class: q.allowed ? "egress-allowed" : "egress-refused" },
      `${new Date(q.at * 1000).toLocaleTimeString()} ${q.line}`));
  const list = el("ul", {}, ...rows);
  list.id = "egress";
  return section("Network",
    el("p", {}, n.reach),
    n.summary ? el("p", {}, n.summary) : null,
    rows.length ? list : null);
}

async function showRun(runId) {
  await drawRun(runId);
  let pending = null;
  follow(Date.now() / 1000, (changed) => {
    if (!changed.some((c) => c.run_id === runId || c.parent_run_id === runId)) return;
    clearTimeout(pending);
    pending = setTimeout(() => drawRun(runId), 100);
  });
}

// -- the stream ----------------------------------------------------------------------------
function follow(since, onRuns) {
  const source = new EventSource(`/api/stream?since=${since}`);
  source.addEventListener("open", () => { live.textContent = "live"; });
  source.addEventListener("error", () => { live.textContent = "reconnecting…"; });
  source.addEventListener("runs", (e) => onRuns(JSON.parse(e.data)));
  source.addEventListener("store", (e) => {
    const said = JSON.parse(e.data);
    if (said.state === "away") storeAway(String(said.error));
    else storeBack();
  });
}

function runOfPath() {
  const match = location.pathname.match(/^\/run\/([^/]+)$/);
  if (!match) return null;
  try {
    return decodeURIComponent(match[1]);
  } catch {
    return match[1];
  }
}

const shown = runOfPath();
if (shown !== null) showRun(shown);
else showList();
