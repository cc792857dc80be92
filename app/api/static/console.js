// Flywheel operator console: polls the admin API with the token kept in sessionStorage.
// Everything is drawn with the DOM (textContent, never innerHTML) and SVG; no dependencies.
"use strict";

const TOKEN_KEY = "flywheel-admin-token";
const POLL_MS = 3000;
const COLORS = ["#3467d6", "#d6573a", "#1b9e5a", "#8e44ad", "#c99a06", "#0f8ea8", "#c2185b"];
const $ = (id) => document.getElementById(id);
let timer = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

class Unauthorized extends Error {}

async function api(path, method = "GET", body = undefined) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body && JSON.stringify(body) });
  if (r.status === 401) throw new Unauthorized("wrong admin token");
  const data = await r.json();
  if (!r.ok) throw new Error(data.error ? data.error.message : `HTTP ${r.status}`);
  return data;
}

const fmt = (x, digits = 3) => (typeof x === "number" ? x.toFixed(digits) : "–");
const bytes = (n) => (n == null ? "–" : n < 1024 ? `${n} B` : n < 1048576
  ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(2)} MiB`);

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

// ---- releases ----------------------------------------------------------------------------
function gate(release) {
  const s = release.eval_summary || {};
  const figures = Object.keys(s).filter((k) => k.startsWith("candidate_")).map((k) => {
    const metric = k.slice("candidate_".length);
    return `${metric} ${fmt(s[k])} vs ${fmt(s["served_" + metric])}`;
  });
  const decision = release.status === "rejected" ? "refused" : release.status === "candidate"
    ? "pending" : release.parent == null ? "base" : "passed";
  if (typeof s.change === "number") {  // the paired test over the held-out tasks
    figures.push(`change ${fmt(s.change)}, upper bound ${fmt(s.change_upper)}`);
  }
  const cell = el("td", { class: "gate", "data-decision": decision }, decision);
  if (figures.length) cell.append(el("br"), el("small", {}, figures.join("; ")));
  if (release.status === "rejected") cell.append(el("br"), el("small", {}, release.reason));
  return cell;
}

// Every replica heard from lately that serves `version` (app/api/replicas.py); this one in bold.
function servedBy(version, replica, replicas) {
  const cell = el("td", { class: "served-by" });
  for (const p of replicas.filter((p) => p.version === version)) {
    if (cell.childNodes.length) cell.append(el("br"));
    cell.append(el("span", { class: p.id === replica.id ? "serving replica" : "replica",
      "data-replica": p.id }, p.id));
  }
  return cell;
}

function releaseRow(r, replica, replicas, delta, head) {
  const steps = r.step_range ? `steps ${r.step_range[0]}–${r.step_range[1]}` : "no steps";
  const row = el("tr", { "data-version": r.version, "data-status": r.status },
    el("td", {}, `v${r.version}`), el("td", {}, r.parent == null ? "–" : `v${r.parent}`),
    el("td", { class: r.status }, r.status.replace("_", " ")),
    el("td", {}, el("code", { title: r.sha256 }, r.sha256.slice(0, 12))),
    el("td", { class: "num" }, bytes(delta[String(r.version)])), gate(r),
    el("td", {}, `${steps}, ${r.generation_ids.length} generations, ` +
      `${r.feedback_event_ids.length} feedback events`),
    servedBy(r.version, replica, replicas));
  const actions = el("td");
  if (head && r.version === head.version && r.parent != null) {
    const button = el("button", { class: "rollback", "data-version": r.version }, "Roll back");
    button.addEventListener("click", () => act(`/admin/releases/${r.version}/rollback`,
      { reason: "console rollback" }, $("release-outcome"),
      (d) => `rolled back v${r.version}: v${d.version} is the head`));
    actions.append(button);
  }
  row.append(actions);
  return row;
}

// The served version before the pipeline's first run has recorded it (the base model, v0).
function baseRow(status, replica, replicas) {
  return el("tr", { "data-version": status.model_version, "data-status": "served" },
    el("td", {}, `v${status.model_version}`), el("td", {}, "–"), el("td", {}, "served"),
    el("td", {}, el("code", { title: status.model_sha256 }, status.model_sha256.slice(0, 12))),
    el("td", { class: "num" }, "–"),
    el("td", { class: "gate", "data-decision": "base" }, "base model"),
    el("td", {}, "not in the release history yet"),
    servedBy(status.model_version, replica, replicas), el("td"));
}

// ---- canaries (trainer/release/canary_stage.py) ----------------------------------------------
// One metric's sequential test: both arms (mean, sessions), the difference with its 95%
// interval, the log-likelihood ratio and the metric's decision.
function armsCell(f) {
  if (!f) return el("td", {}, "–");
  return el("td", { class: "num arms" },
    `${fmt(f.candidate_mean)} (n=${f.candidate_sessions}) vs ` +
    `${fmt(f.incumbent_mean)} (n=${f.incumbent_sessions})`, el("br"),
    el("small", {}, `diff ${fmt(f.difference)} [${fmt(f.low)}, ${fmt(f.high)}], ` +
      `LLR ${fmt(f.llr, 2)}: ${f.decision}`));
}

function canaryRow(c) {
  const open = c.status === "running" || c.status === "held";
  const row = el("tr", { "data-version": c.version, "data-status": c.status },
    el("td", {}, `v${c.version}`), el("td", {}, `v${c.parent}`),
    el("td", { class: "num" }, `${(100 * c.share).toFixed(0)}%`),
    el("td", { class: c.status }, c.status.replace("_", " ")),
    armsCell(c.figures.acceptance), armsCell(c.figures.reward),
    el("td", { class: "decision" }, open ? c.reason || "deciding"
      : `${c.decided_by}: ${c.reason}`));
  const actions = el("td");
  if (open) {
    for (const [cls, label, path, verb] of [["promote", "Promote", "promote", "promoted"],
      ["end-canary", "Roll back", "rollback", "rolled back"]]) {
      const button = el("button", { class: cls, "data-version": c.version }, label);
      button.addEventListener("click", () => act(`/admin/releases/${c.version}/${path}`,
        { reason: `console ${verb}` }, $("canary-outcome"), () => `v${c.version} ${verb}`));
      actions.append(button);
    }
  }
  row.append(actions);
  return row;
}

// ---- acceptance chart ----------------------------------------------------------------------
function drawChart(series) {
  const chart = $("acceptance-chart");
  const W = 720, H = 240, L = 40, R = 110, T = 10, B = 24;
  const points = series.flatMap((s) => s.points);
  chart.replaceChildren();
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    svg("text", { x: 4, y: T + 8 }, "100%"), svg("text", { x: 14, y: H - B }, "0%"));
  if (!points.length) {
    chart.append(svg("text", { x: L + 12, y: H / 2 }, "no joined feedback yet"));
    return;
  }
  const t0 = Math.min(...points.map((p) => p[0])), t1 = Math.max(...points.map((p) => p[0]));
  const x = (t) => L + (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5) * (W - L - R);
  const y = (a) => H - B - a * (H - T - B);
  chart.append(svg("text", { x: L, y: H - 6 }, new Date(t0 * 1000).toLocaleTimeString()),
    svg("text", { x: W - R - 60, y: H - 6 }, new Date(t1 * 1000).toLocaleTimeString()));
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[2]).toFixed(1)}`).join(" ");
    const g = svg("g", { class: "series-group", "data-version": s.version });
    g.append(svg("polyline", { class: "series", "data-version": s.version, stroke: color,
      points: pts }));
    for (const p of s.points) {
      g.append(svg("circle", { cx: x(p[0]), cy: y(p[2]), r: 2.5, fill: color }));
    }
    g.append(svg("text", { x: W - R + 8, y: T + 14 + i * 16, fill: color },
      `v${s.version} ${(100 * s.acceptance).toFixed(0)}%`));
    chart.append(g);
  });
}

// ---- the rest --------------------------------------------------------------------------------
function drawTrainer(trainer, produced) {
  const dl = $("trainer");
  if (!trainer) {
    dl.replaceChildren(el("dt", {}, "status"), el("dd", {}, "no trainer has reported yet"));
    return;
  }
  const m = trainer.metrics || {};
  const items = [["step", trainer.step], ["paused", trainer.paused ? "yes" : "no"],
    ["loss", fmt(m.loss)], ["reward", fmt(m.reward)], ["KL", fmt(m.kl, 5)],
    ["clip fraction", fmt(m.clipped)],
    ["consumed / produced", `${trainer.consumed} / ${produced}`],
    ["lag (experiences)", trainer.lag ?? "–"],
    ["last release", trainer.last_release_version == null ? "–"
      : `v${trainer.last_release_version}`],
    ["monitors", (trainer.breaches || []).length === 0 ? "no breach"
      : trainer.breaches.map((b) => `${b.monitor} on v${b.version}: ${fmt(b.value, 3)} against `
        + `${fmt(b.baseline, 3)} (threshold ${b.threshold}); sessions `
        + `${b.sessions.slice(0, 5).join(", ") || "–"}`).join(" · ")]];
  dl.replaceChildren(...items.flatMap(([k, v]) => [el("dt", {}, k),
    el("dd", { "data-field": k }, v)]));
}

async function act(path, body, outcome, describe) {
  outcome.textContent = "…";
  outcome.className = "outcome";
  let answer;
  try {
    answer = await api(path, "POST", body);
  } catch (err) {
    if (err instanceof Unauthorized) return signOut(err.message);
    outcome.textContent = err.message;
    outcome.className = "outcome error";
    return;
  }
  outcome.textContent = describe(answer);
  await update();  // the action's outcome stands, whatever the page's refresh meets
}

async function refresh() {
  const [status, releases, trainer, figures, canaries] = await Promise.all([
    api("/admin/status"), api("/admin/releases?limit=50"), api("/admin/trainer"),
    api("/admin/console"), api("/admin/releases/canaries")]);
  const served = status.model_version;
  $("served").textContent = `serving v${served} (${status.model_sha256.slice(0, 12)})`;
  $("served").dataset.version = served;
  const head = releases.find((r) => r.status === "published");
  const rows = releases.map((r) => releaseRow(r, figures.replica, figures.replicas,
    figures.delta_bytes, head));
  if (!releases.some((r) => r.version === served)) {
    rows.push(baseRow(status, figures.replica, figures.replicas));
  }
  fill(document.querySelector("#releases tbody"), rows);
  fill(document.querySelector("#canaries tbody"), canaries.map(canaryRow));
  drawChart(figures.acceptance);
  fill(document.querySelector("#acceptance tbody"), figures.acceptance.map((s) =>
    el("tr", { "data-version": s.version }, el("td", {}, `v${s.version}`),
      el("td", { class: "num" }, s.experiences),
      el("td", { class: "num" }, `${(100 * s.acceptance).toFixed(1)}%`),
      el("td", { class: "num" }, fmt(s.mean_reward)))));
  drawTrainer(trainer.trainer, figures.experiences_produced);
  fill(document.querySelector("#join-lag tbody"), figures.join_lag.map((p) =>
    el("tr", {}, el("td", {}, p.topic), el("td", { class: "num" }, p.partition),
      el("td", { class: "num" }, p.end), el("td", { class: "num" }, p.committed ?? "–"),
      el("td", { class: "num" }, p.lag))));
  $("spool").textContent = `${figures.spool.records} records, ${bytes(figures.spool.bytes)}`;
  const { generations, private: hidden } = figures.private;
  $("private").textContent = `${hidden} of ${generations} generations` +
    (generations ? ` (${(100 * hidden / generations).toFixed(1)}%)` : "") +
    " in privacy mode: served, never logged nor trained on";
  fill(document.querySelector("#rejections tbody"),
    Object.entries(figures.webhook_rejections).map(([reason, n]) =>
      el("tr", {}, el("td", {}, reason), el("td", { class: "num" }, n))));
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// One refresh; false when the token was refused (signed out). A failure shows beside the
// time of the last update, and the next poll tries again.
async function update() {
  try {
    await refresh();
  } catch (err) {
    if (err instanceof Unauthorized) {
      signOut(err.message);
      return false;
    }
    $("updated").textContent = `update failed: ${err.message}`;
  }
  return true;
}

async function poll() {
  if (await update()) timer = setTimeout(poll, POLL_MS);
}

function signOut(message = "") {
  clearTimeout(timer);
  sessionStorage.removeItem(TOKEN_KEY);
  for (const id of ["releases", "canaries", "acceptance", "join-lag", "rejections"]) {
    document.querySelector(`#${id} tbody`).replaceChildren();
  }
  for (const id of ["trainer", "acceptance-chart", "spool", "served"]) $(id).replaceChildren();
  $("console").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
}

async function signIn(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
  try {
    await api("/admin/status");
  } catch (err) {
    return signOut(err instanceof Unauthorized ? "wrong admin token" : err.message);
  }
  $("login").hidden = true;
  $("login-error").textContent = "";
  $("console").hidden = false;
  $("logout").hidden = false;
  poll();
}

$("login").addEventListener("submit", (e) => {
  e.preventDefault();
  signIn($("token").value);
  $("token").value = "";
});
$("logout").addEventListener("click", () => signOut());
$("release-now").addEventListener("click", () => act("/admin/releases",
  { reason: "console release" }, $("release-outcome"), (d) => `v${d.version} queued`));
$("trainer-pause").addEventListener("click", () => act("/admin/trainer/pause",
  { reason: "console" }, $("trainer-outcome"), (d) => `pause queued (#${d.command_id})`));
$("trainer-resume").addEventListener("click", () => act("/admin/trainer/resume",
  { reason: "console" }, $("trainer-outcome"), (d) => `resume queued (#${d.command_id})`));
if (sessionStorage.getItem(TOKEN_KEY)) signIn(sessionStorage.getItem(TOKEN_KEY));
