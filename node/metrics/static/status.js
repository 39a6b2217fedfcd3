// The node's status page: polls /api/status and draws it. Plain DOM and inline SVG, no
// library and no network beyond this node (the machine may be offline). The helpers it
// shares with a testnet's swarm page (el, fmt, lossText, poll, ...) are in common.js,
// which the page loads first.
"use strict";

function rows(tbody, list) {
  tbody.replaceChildren(...list);
}

function kv(pairs) {
  return pairs.map(([k, v]) => {
    const tr = el("tr");
    tr.append(el("th", {}, k), el("td", { class: "num" }, v));
    return tr;
  });
}

function header(st) {
  $("title").textContent = st.run_name ? "peertrain · " + st.run_name
    : "peertrain " + (st.role || "node");
  document.title = $("title").textContent;
  const meta = $("meta");
  meta.replaceChildren();
  const add = (k, v, code, attrs) => {
    meta.append(k + " ");
    meta.append(code ? el("code", {}, v) : el("b", attrs || {}, v));
    meta.append("   ");
  };
  add("phase", st.phase);
  const pipe = st.pipeline;
  if (pipe && pipe.phase) {  // `stalled: waiting for stage 2 since 40 s` (node/pipe/stall.py)
    add("pipeline", "stage " + pipe.stage + " of " + pipe.stages + ": " + pipe.phase, false,
      { id: "pipeline-phase", style: pipe.stall ? "color: var(--warn)" : "" });
  }
  add("device", st.device || "–");
  add("uptime", duration(st.uptime_s || 0));
  if (st.run) add("run", st.run, true);
  add("peer", st.peer_id, true);
}

function cards(st) {
  const t = training(st);
  const live = ((st.membership || {}).peers || []).length;
  const items = [
    ["step", t.step ?? "–"], ["train loss", lossText(t)], ["validation loss", fmt(t.val_loss)],
    ["rounds averaged", t.rounds_averaged ?? "–"], ["rounds local", t.rounds_local ?? "–"],
    ["peers live", st.membership ? live : "–"], ["connections", (st.p2p || {}).connections ?? 0],
    ["compute share", t.compute_fraction !== undefined
      ? Math.round(t.compute_fraction * 100) + " %" : "–"],
  ];
  $("cards").replaceChildren(...items.map(([k, v]) => {
    const c = el("div", { class: "card" });
    c.append(el("div", { class: "v" }, v), el("div", { class: "k" }, k));
    return c;
  }));
}

// history rows: [unix time, step, train loss, validation loss]
function chart(history) {
  const svg = $("loss-chart");
  const W = 900, H = 280, L = 52, R = 12, T = 10, B = 30;
  svg.replaceChildren();
  const pts = history.filter((h) => h[2] !== null || h[3] !== null);
  $("chart-note").textContent = pts.length
    ? "by step · " + pts.length + " points, steps " + pts[0][1] + "–" + pts[pts.length - 1][1]
    : "no training step yet";
  if (!pts.length) return;
  const losses = pts.flatMap((h) => [h[2], h[3]]).filter((v) => v !== null && isFinite(v));
  const { x, y } = lossFrame(svg, { W, H, L, R, T, B }, losses, pts[0][1],
    pts[pts.length - 1][1]);
  const curve = (idx, color, id) => {
    const p = pts.filter((h) => h[idx] !== null && isFinite(h[idx]));
    if (!p.length) return;
    const d = p.map((h, i) => (i ? "L" : "M") + x(h[1]).toFixed(1) + " " + y(h[idx]).toFixed(1));
    svg.append(svgEl("path", { id, d: d.join(" "), fill: "none", stroke: color,
      "stroke-width": 2, "data-points": p.length }));
    if (p.length === 1) {
      svg.append(svgEl("circle", { cx: x(p[0][1]), cy: y(p[0][idx]), r: 3, fill: color }));
    }
  };
  curve(2, "var(--train)", "train-curve");
  curve(3, "var(--val)", "val-curve");
}

function peers(st) {
  const now = st.now_unix;
  const live = (st.membership || {}).peers || [];
  const partners = (st.averaging || {}).partners || {};
  const paths = st.paths || {};
  const ids = [...new Set([...live.map((p) => p.peer_id), ...Object.keys(partners)])].sort();
  const byId = Object.fromEntries(live.map((p) => [p.peer_id, p]));
  rows($("peers"), ids.map((id) => {
    const p = byId[id] || {}, a = partners[id] || {}, s = p.stats || {};
    const path = paths[id] || "none";
    const tr = el("tr", { "data-peer": id });
    const pathCell = el("td");
    pathCell.append(el("span", { class: "pill " + path }, path === "none" ? "not connected" : path));
    const sum = (o) => Object.values(o || {}).reduce((x, y) => x + y, 0);
    const last = a.last_exchange_unix
      ? ago(now - a.last_exchange_unix) + (a.last_seconds ? " (" + a.last_seconds.toFixed(2) + " s)" : "")
      : "–";
    tr.append(el("td", { title: id }, short(id)), pathCell,
      el("td", { class: "num" }, s.step ?? "–"), el("td", { class: "num" }, fmt(s.loss)),
      el("td", {}, p.device || "–"),
      el("td", { class: "num" }, p.last_seen_s !== undefined ? ago(p.last_seen_s) : "gone"),
      el("td", { class: "num" }, a.exchanges ?? 0), el("td", { class: "num" }, a.failures ?? 0),
      el("td", {}, last), el("td", { class: "num" }, mb(sum(a.bytes_sent))),
      el("td", { class: "num" }, mb(sum(a.bytes_received))));
    return tr;
  }));
  if (!ids.length) {
    const tr = el("tr");
    tr.append(el("td", { colspan: 11, class: "meta" }, "no peers heard yet"));
    rows($("peers"), [tr]);
  }
}

function rounds(st) {
  const t = training(st), a = st.averaging || {};
  const h = a.exchange_seconds;
  const mean = h && h.count ? (h.sum / h.count).toFixed(2) + " s" : "–";
  rows($("rounds"), kv([
    ["round", t.round ?? "–"], ["averaged", t.rounds_averaged ?? "–"],
    ["local (no partner)", t.rounds_local ?? "–"], ["last partner", short(t.last_partner)],
    ["mean exchange", mean], ["MB sent", mb(t.bytes_sent)], ["MB received", mb(t.bytes_received)],
  ]));
}

function checkpoints(st) {
  const list = (st.checkpoints || []).slice().reverse();
  if (!list.length) {
    const tr = el("tr");
    tr.append(el("td", { colspan: 4, class: "meta" }, "none held"));
    rows($("checkpoints"), [tr]);
    return;
  }
  rows($("checkpoints"), list.map((c) => {
    const tr = el("tr"), id = el("td");
    id.append(el("code", { title: c.cid }, short(c.cid)));
    tr.append(id, el("td", { class: "num" }, c.step), el("td", { class: "num" }, mb(c.bytes)),
      el("td", {}, ago(st.now_unix - c.created_ms / 1000)));
    return tr;
  }));
}

function phases(st) {
  const entries = Object.entries(st.phase_times || {}).sort((a, b) => a[1] - b[1]);
  rows($("phases"), kv(entries.map(([k, v]) => [k, v.toFixed(2) + " s"])));
}

function network(st) {
  const p = st.p2p || {}, g = st.guard || {};
  const refused = Object.values(g.refused || {}).reduce((x, y) => x + y, 0);
  rows($("network"), kv([
    ["connections", p.connections ?? 0], ["DHT routing table", p.dht_routing_table ?? 0],
    ["banned peers", Object.keys(g.bans || {}).length], ["refused streams", refused],
    ["handler errors", p.handler_errors ?? 0], ["addresses", (st.addrs || []).length],
  ]));
}

// What must not be missed (the node's `warnings`: averaging stalled, training stopped)
// and its last WARNING/ERROR log records; the panel is hidden while there are none.
function problems(st) {
  const warnings = st.warnings || [], recent = (st.recent_problems || []).slice().reverse();
  $("problems-section").hidden = !warnings.length && !recent.length;
  $("warnings").replaceChildren(...warnings.map((w) => el("li", {}, w)));
  rows($("problems"), recent.map((r) => {
    const tr = el("tr", { class: r.level });
    tr.append(el("td", {}, ago(st.now_unix - r.ts)), el("td", {}, r.level),
      el("td", {}, r.logger), el("td", {}, r.msg));
    return tr;
  }));
}

poll("/api/status", (st) => {
  header(st); problems(st); cards(st); chart(st.history || []); peers(st); rounds(st);
  checkpoints(st); phases(st); network(st);
}, "cannot reach the node");
