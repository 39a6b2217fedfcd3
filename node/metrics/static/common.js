// What the node's status page (status.js, node/metrics/) and a testnet's swarm page
// (testnet/static/swarm.js) share: DOM and SVG builders, number formats, the loss rules,
// the loss chart's frame and the polling loop. Each page loads this script first, from its
// own server (`/common.js`): plain DOM, no library, nothing fetched from elsewhere.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
}

const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
const short = (p) => (p && p.length > 14 ? p.slice(0, 8) + "…" + p.slice(-4) : p || "–");
const mb = (n) => (n ? (n / 1e6).toFixed(1) : "0");

function duration(seconds) {
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

const ago = (seconds) => (seconds === null || seconds === undefined ? "–"
  : duration(seconds) + " ago");

// A pipeline's last stage computes its loss every step: one older than LOSS_OLD_S is shown
// with its age, never as the current loss (cli/render.py has the same rule).
const LOSS_OLD_S = 30;
function lossText(t) {
  const age = t.loss_age_s;
  if (t.loss === null || t.loss === undefined || !(age > LOSS_OLD_S)) return fmt(t.loss);
  return fmt(t.loss) + " (" + (age < 90 ? Math.round(age) + " s" : Math.round(age / 60) + " min")
    + " old)";
}

// The training numbers: a pipeline host keeps them under its pipeline's status.
const training = (st) => st.training || (st.pipeline || {}).training || {};

// A loss chart's frame in `svg`: five grid lines labelled with losses (y, padded 5% around
// `losses`) and five step labels from s0 to s1 (x), inside margins L, R, T, B of a W x H
// view box. Returns the scales {x(step), y(loss)} the page draws its curves with.
function lossFrame(svg, { W, H, L, R, T, B }, losses, s0, s1) {
  let lo = Math.min(...losses), hi = Math.max(...losses);
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const pad = (hi - lo) * 0.05; lo -= pad; hi += pad;
  s1 = Math.max(s1, s0 + 1);
  const x = (s) => L + ((s - s0) / (s1 - s0)) * (W - L - R);
  const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = lo + ((hi - lo) * i) / 4;
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eef1f4" }));
    svg.append(svgEl("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  for (let i = 0; i <= 4; i++) {
    const s = Math.round(s0 + ((s1 - s0) * i) / 4);
    svg.append(svgEl("text", { x: x(s), y: H - 10, "text-anchor": "middle" }, s));
  }
  return { x, y };
}

// The page's loop: fetch `url` every REFRESH_MS and `draw` its JSON; once drawn, the body
// carries data-loaded="1" (what the headless-Chromium tests wait for). A failure shows in
// #error as "<unreachable>: <why>", and the next round tries again.
function poll(url, draw, unreachable) {
  async function refresh() {
    try {
      const r = await fetch(url, { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const doc = await r.json();
      $("error").textContent = "";
      draw(doc);
      document.body.setAttribute("data-loaded", "1");
    } catch (e) {
      $("error").textContent = unreachable + ": " + e.message;
    }
    setTimeout(refresh, REFRESH_MS);
  }
  refresh();
}
