// The swarm page: polls /api/swarm (every node of the testnet, read by the launcher through
// each node's control socket) and draws it. Plain DOM and inline SVG, no library, nothing
// fetched from anywhere but this page's server (the machine may be offline). The helpers it
// shares with a node's status page (el, fmt, lossText, poll, ...) are node/metrics'
// static/common.js, which this page's server serves too and the page loads first.
"use strict";

const COLORS = ["#2c6fbb", "#d9822b", "#2e8540", "#8e44ad", "#c0392b", "#16a085",
  "#7f8c8d", "#b7950b", "#e84393", "#34495e"];

// A node keeps its colour while the page is open, whatever order the nodes come in.
const colorOf = {};
function color(name) {
  if (!(name in colorOf)) colorOf[name] = COLORS[Object.keys(colorOf).length % COLORS.length];
  return colorOf[name];
}

function header(doc) {
  const up = doc.nodes.filter((n) => n.up).length;
  $("title").textContent = "peertrain testnet" + (doc.run ? " · run " + short(doc.run) : "");
  document.title = $("title").textContent;
  const meta = $("meta");
  meta.replaceChildren();
  const add = (k, v, code) => {
    meta.append(k + " ");
    meta.append(code ? el("code", {}, v) : el("b", {}, v));
    meta.append("   ");
  };
  add("nodes up", up + " of " + doc.nodes.length);
  if (doc.nodes.length - up) add("down", doc.nodes.length - up);
  if (doc.partition) add("partition", doc.partition.map((s) => s.join(" ")).join("  |  "));
  if (doc.run) add("run", doc.run, true);
  add("directory", doc.dir, true);
}

function nodeRows(doc) {
  $("nodes").replaceChildren(...doc.nodes.map((n) => {
    const st = n.status || {}, t = training(st), a = st.averaging || {};
    const byPath = st.peers_by_path || {};
    const h = a.exchange_seconds;
    const ckpts = st.checkpoints || [];
    const newest = ckpts.length ? Math.max(...ckpts.map((c) => c.step)) : null;
    const tr = el("tr", { "data-node": n.name, "data-up": n.up ? "1" : "0",
      class: n.up ? "up" : "down" });
    const name = el("td");
    name.append(el("span", { class: "swatch", style: "background:" + color(n.name) }), n.name);
    const state = el("td");
    state.append(el("span", { class: "pill " + (n.up ? "up" : "down") },
      n.up ? "up" : "down: " + n.state));
    const peer = el("td", { title: st.peer_id || "" });
    peer.append(el("code", {}, short(st.peer_id)));
    // a running pipeline host: its pipeline's phase (`stalled: waiting for stage 2 since
    // 40 s`, node/pipe/stall.py), which its warnings then need not repeat
    const pipe = st.pipeline || {};
    const now = st.phase === "running" && pipe.phase ? pipe.phase : st.phase;
    const phase = now ? (n.up ? now : "was " + now) : "–";
    const phaseCell = el("td", pipe.stall ? { class: "warning" } : {}, phase);
    for (const w of st.warnings || []) {  // averaging stalled, training stopped
      if (w === "pipeline " + now) continue;
      phaseCell.append(el("div", { class: "warning", title: w }, "⚠ " + w));
    }
    tr.append(name, state, phaseCell,
      el("td", { class: "num" }, t.step ?? "–"), el("td", { class: "num" }, lossText(t)),
      el("td", { class: "num" }, fmt(t.val_loss)),
      el("td", { class: "num" }, st.membership ? (st.membership.peers || []).length : "–"),
      el("td", { class: "num" }, (byPath.direct ?? "–") + " / " + (byPath.relayed ?? "–")),
      el("td", { class: "num" }, (t.rounds_averaged ?? "–") + " / " + (t.rounds_local ?? "–")),
      el("td", { class: "num" }, h && h.count ? (h.sum / h.count).toFixed(2) + " s" : "–"),
      el("td", { class: "num" }, ckpts.length + (newest !== null ? " (step " + newest + ")" : "")),
      el("td", {}, st.device || "–"),
      el("td", { class: "num" }, n.seen_unix ? ago(doc.now_unix - n.seen_unix) : "never"),
      peer);
    return tr;
  }));
}

// history rows: [unix time, step, train loss, validation loss]; one train line (solid) and
// one validation line (dashed) per node, in the node's colour; a down node's lines fade.
function chart(doc) {
  const svg = $("loss-chart");
  const W = 1100, H = 320, L = 52, R = 12, T = 10, B = 30;
  svg.replaceChildren();
  const series = doc.nodes.map((n) => ({ n, h: ((n.status || {}).history || [])
    .filter((p) => p[2] !== null || p[3] !== null) })).filter((s) => s.h.length);
  const legend = $("legend");
  legend.replaceChildren();
  for (const s of series) {
    const span = el("span");
    span.append(el("i", { style: "border-color:" + color(s.n.name) }),
      s.n.name + (s.n.up ? "" : " (down)"));
    legend.append(span);
  }
  const note = el("span", { class: "meta" });
  note.append(el("i", { class: "dashed", style: "border-color:#5d6b7e" }), "validation");
  legend.append(note);
  if (!series.length) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" },
      "no training step yet"));
    return;
  }
  const all = series.flatMap((s) => s.h);
  const losses = all.flatMap((p) => [p[2], p[3]]).filter((v) => v !== null && isFinite(v));
  const { x, y } = lossFrame(svg, { W, H, L, R, T, B }, losses,
    Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1])));
  for (const { n, h } of series) {
    for (const [idx, kind] of [[2, "train"], [3, "val"]]) {
      const p = h.filter((q) => q[idx] !== null && isFinite(q[idx]));
      if (!p.length) continue;
      const d = p.map((q, i) => (i ? "L" : "M") + x(q[1]).toFixed(1) + " " + y(q[idx]).toFixed(1));
      const attrs = { id: kind + "-" + n.name, class: kind + "-curve", "data-node": n.name,
        d: d.join(" "), fill: "none", stroke: color(n.name), "stroke-width": 2,
        "data-points": p.length, opacity: n.up ? 1 : 0.35 };
      if (kind === "val") attrs["stroke-dasharray"] = "6 4";
      svg.append(svgEl("path", attrs));
      if (p.length === 1) {
        svg.append(svgEl("circle", { cx: x(p[0][1]), cy: y(p[0][idx]), r: 3,
          fill: color(n.name) }));
      }
    }
  }
}

// Which path each node has to each other node (its substrate's connections, by peer id).
function paths(doc) {
  const names = doc.nodes.map((n) => n.name);
  const byPeer = {};
  for (const n of doc.nodes) if (n.status && n.status.peer_id) byPeer[n.status.peer_id] = n.name;
  const head = el("tr");
  head.append(el("th", {}, ""), ...names.map((m) => el("th", {}, m)));
  $("paths-head").replaceChildren(head);
  $("paths").replaceChildren(...doc.nodes.map((n) => {
    const seen = {};
    for (const [peer, path] of Object.entries((n.status || {}).paths || {})) {
      if (byPeer[peer]) seen[byPeer[peer]] = path;
    }
    const tr = el("tr", { "data-node": n.name, class: n.up ? "up" : "down" });
    tr.append(el("th", {}, n.name), ...names.map((m) => {
      const td = el("td");
      if (m === n.name) td.textContent = "·";
      else if (!n.up) td.textContent = "–";
      else td.append(el("span", { class: "pill " + (seen[m] || "none") }, seen[m] || "none"));
      return td;
    }));
    return tr;
  }));
}

poll("/api/swarm", (doc) => {
  $("error").textContent = doc.error || "";
  header(doc); nodeRows(doc); chart(doc); paths(doc);
}, "cannot reach the testnet launcher");
