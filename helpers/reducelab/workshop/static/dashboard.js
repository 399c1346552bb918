// Reduce Lab workshop dashboard: one row per learner, one column per question and
// exercise. It renders the server's snapshot (GET /api/progress) and every update the
// server pushes (server-sent events on /api/events), without reloading. Names and all
// other text from the server go in as text (textContent), never as HTML.
"use strict";
const token = new URLSearchParams(location.search).get("token") || "";
const auth = { Authorization: "Bearer " + token };
let snapshot = null, skew = 0;

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};
const now = () => Date.now() / 1000 + skew;
const minutes = (s) => Math.max(0, Math.floor(s / 60));
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

// Highlighted: the learner's latest report is a group call that timed out, or their
// latest exercise check failed (on an exercise not passed since) N or more minutes ago.
function flagOf(learner, stuckAfter) {
  const last = learner.last, check = learner.last_check;
  if (last && last.outcome === "timeout")
    return "⚠ group call timed out " + minutes(now() - last.at) + " min ago";
  if (check && check.outcome === "failed" && now() - check.at >= stuckAfter * 60) {
    const cell = learner.cells[check.notebook + ":" + check.item];
    if (!cell || cell.state !== "passed") return "⚠ stuck " + minutes(now() - check.at) + " min";
  }
  return null;
}

function visibleNotebooks() {
  const choice = $("notebook").value, nbs = Object.keys(snapshot.catalog.notebooks);
  if (choice === "all") return nbs;
  if (choice !== "active") return [choice];
  const active = new Set();
  for (const l of snapshot.learners) for (const k of Object.keys(l.cells)) active.add(k.slice(0, 2));
  return active.size ? nbs.filter((n) => active.has(n)) : nbs;
}

function unlockButton(item) {
  const open = snapshot.unlocked.includes(item.solution);
  const b = el("button", "unlock", open ? "✓ solution open · close it" : "open the solution");
  b.dataset.open = String(open);
  b.dataset.solution = item.solution;
  b.title = (open ? "Learners can load " : "Let learners load ") + item.solution;
  b.addEventListener("click", async () => {
    b.disabled = true;
    const r = await fetch("/api/unlock", { method: "POST",
      headers: { ...auth, "Content-Type": "application/json" },
      body: JSON.stringify({ solution: item.solution, open: !open }) });
    if (!r.ok) alert((await r.json()).error);
    b.disabled = false;
  });
  return b;
}

function render() {
  if (!snapshot) return;
  const select = $("notebook");
  if (select.options.length === 2) {
    for (const [nb, stem] of Object.entries(snapshot.catalog.notebooks))
      select.append(new Option(stem, nb));
  }
  const typed = parseFloat($("stuck-minutes").value), stuckAfter = typed >= 0 ? typed : 5;
  const nbs = new Set(visibleNotebooks());
  const items = snapshot.catalog.items.filter((i) => nbs.has(i.notebook));
  const thead = $("board").tHead, tbody = $("board").tBodies[0];
  thead.replaceChildren();
  tbody.replaceChildren();
  const top = el("tr"), sub = el("tr");
  top.append(el("th", "name", "learner"));
  sub.append(el("th", "name", ""));
  for (const nb of nbs) {
    const span = items.filter((i) => i.notebook === nb).length;
    if (!span) continue;
    const th = el("th", "notebook", snapshot.catalog.notebooks[nb]);
    th.colSpan = span;
    top.append(th);
  }
  for (const item of items) {
    const th = el("th", item.kind, item.kind === "exercise" ? "exercise " + item.label : item.label);
    th.dataset.column = item.notebook + ":" + item.key;
    if (item.kind === "exercise") { th.append(el("br")); th.append(unlockButton(item)); }
    sub.append(th);
  }
  thead.append(top, sub);
  let flagged = 0;
  for (const learner of snapshot.learners) {
    const tr = el("tr");
    tr.dataset.learner = learner.id;
    const name = el("td", "name", learner.name);
    const flag = flagOf(learner, stuckAfter);
    if (flag) { tr.classList.add("flagged"); name.append(el("span", "flag", flag)); flagged++; }
    tr.append(name);
    for (const item of items) {
      const key = item.notebook + ":" + item.key, c = learner.cells[key];
      const td = el("td", "cell " + (c ? c.state : "empty"));
      td.dataset.column = key;
      if (c && c.state === "passed") {
        td.textContent = "✓";
        td.title = "passed at " + clock(c.passed) + (c.tries ? " after " + c.tries + " failed tries" : "");
      } else if (c && c.state === "failing") {
        td.textContent = "✗ " + c.tries + " · " + minutes(now() - c.since) + " min";
        td.title = c.tries + " tries since " + clock(c.since) + (c.mistake ? "; last: " + c.mistake : "");
      } else if (c) {
        td.textContent = "·";
        td.title = "reached at " + clock(c.last) + ", no prediction yet";
      } else {
        td.title = "not started";
      }
      tr.append(td);
    }
    tbody.append(tr);
  }
  const n = snapshot.learners.length;
  $("summary").textContent = n + " learner" + (n === 1 ? "" : "s") + " · " + snapshot.accepted +
    " reports · " + flagged + " highlighted";
  $("empty").hidden = n > 0;
}

function receive(data) {
  snapshot = data;
  skew = data.now - Date.now() / 1000;
  render();
}

function connect() {
  const source = new EventSource("/api/events?token=" + encodeURIComponent(token));
  source.addEventListener("progress", (e) => {
    $("connection").dataset.state = "live";
    $("connection").textContent = "● live";
    receive(JSON.parse(e.data));
  });
  source.onerror = () => {
    $("connection").dataset.state = "connecting";
    $("connection").textContent = "● reconnecting (the browser retries by itself)";
  };
}

fetch("/api/progress", { headers: auth }).then(async (r) => {
  if (!r.ok) { $("summary").textContent = (await r.json()).error; return; }
  receive(await r.json());
  connect();
});
$("stuck-minutes").addEventListener("input", render);
$("notebook").addEventListener("change", render);
setInterval(render, 15000);  // minutes since, and who is stuck, move on with the clock
