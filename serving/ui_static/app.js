// featurestore web UI: a hash-routed single page over the read-only JSON API (api/...).
// Text from the API is always set as text (never as HTML), so a definition's description or a
// run's tag cannot inject markup.
"use strict";

const main = document.getElementById("main");
const COLORS = ["#2f6fde", "#e0803a", "#1f8a4c", "#b5449a", "#7a5cd6", "#c4372c", "#2a9aa8", "#8a7a2a"];

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// an error's message: ours is one line; FastAPI's validation errors are a list (where, what)
function said(detail) {
  if (!Array.isArray(detail)) return detail;
  return detail.map((e) => `${(e.loc || []).slice(1).join(".")}: ${e.msg}`).join("; ");
}

async function api(path) {
  const response = await fetch("api/" + path, { headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(said(body.detail) || `${response.status} ${response.statusText}`);
  return body;
}

const fmt = {
  duration: (s) => (s === null || s === undefined ? "–" : s < 60 ? `${s.toFixed(1)} s` : s < 3600 ? `${Math.floor(s / 60)} min ${String(Math.floor(s % 60)).padStart(2, "0")} s` : `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`),
  // one notation: grouped digits from 1,000 up, 4 significant digits below, exponents only under 0.001
  num: (v) => (v === null || v === undefined ? "–" : typeof v !== "number" ? String(v) : Number.isInteger(v) || Math.abs(v) >= 1000 ? v.toLocaleString("en-US", { maximumFractionDigits: 1 }) : v !== 0 && Math.abs(v) < 1e-3 ? v.toExponential(2) : String(Number(v.toPrecision(4)))),
  secs: (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
    return `${(s / 86400).toFixed(1)} d`;
  },
  window: (s) => (s % 86400 === 0 ? `${s / 86400}d` : s % 3600 === 0 ? `${s / 3600}h` : s % 60 === 0 ? `${s / 60}min` : `${s}s`),
  pct: (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(2)} %`),
  time: (t) => (t ? new Date(typeof t === "number" ? t * 1000 : t).toISOString().slice(0, 19).replace("T", " ") + " UTC" : "–"),
  short: (hash) => (hash ? hash.slice(0, 12) : "–"),
};

const tags = (obj) => Object.entries(obj || {}).map(([k, v]) => h("span", { class: "tag" }, `${k}=${v}`));
const table = (head, rows) => h("table", {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), h("tbody", {}, rows));
const card = (label, value, cls) => h("div", { class: "card" }, h("div", { class: "label" }, label), h("div", { class: "value " + (cls || "") }, value));
const okMark = (ok) => h("span", { class: ok ? "ok" : "bad" }, ok ? "✓" : "✗");

// Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
function ticks(lo, hi, count = 5) {
  const raw = (hi - lo) / Math.max(count - 1, 1), power = Math.pow(10, Math.floor(Math.log10(raw || 1)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// Ticks on a time axis (epoch seconds): whole hours, days, weeks or months, at most ``count``.
function timeTicks(lo, hi, count = 5) {
  const step = [3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400, 14 * 86400, 30 * 86400, 91 * 86400, 365 * 86400]
    .find((s) => (hi - lo) / s <= count) || 365 * 86400;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) out.push(v);
  return out;
}

const svgNS = "http://www.w3.org/2000/svg";
const ns = (tag, attrs, text) => { const e = document.createElementNS(svgNS, tag); for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); if (text !== undefined) e.textContent = text; return e; };
const hover = (el, text) => { el.append(ns("title", {}, text)); return el; };

// A line chart as SVG: series = [{name, xs, ys}] on shared axes with round ticks, axis names,
// and each point's value on hover. opts: xLabel / yLabel (tick text), xName / yName, yMin / yMax.
function chart(title, series, opts = {}) {
  const W = opts.width || 520, H = opts.height || 230, L = 62, R = 12, T = 12, B = 40;
  const all = series.map((s) => { const keep = s.ys.map((y, j) => y !== null && y !== undefined && Number.isFinite(y) ? j : -1).filter((j) => j >= 0); return { ...s, xs: keep.map((j) => s.xs[j]), ys: keep.map((j) => s.ys[j]) }; }).filter((s) => s.xs.length);
  const svg = ns("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const box = h("div", { class: "chart", "data-title": title }, h("div", { class: "title" }, title), svg);
  if (!all.length) { box.append(h("div", { class: "muted" }, "no points")); return box; }
  const xs = all.flatMap((s) => s.xs), ys = all.flatMap((s) => s.ys);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (opts.yMin !== undefined) y0 = Math.min(y0, opts.yMin);
  if (opts.yMax !== undefined) y1 = Math.max(y1, opts.yMax);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), py = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const xl = opts.xLabel || ((v) => fmt.num(v)), yl = opts.yLabel || ((v) => fmt.num(v));
  svg.append(ns("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }), ns("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccd" }));
  for (const v of ticks(y0, y1, 5)) {
    svg.append(ns("line", { x1: L, y1: py(v), x2: W - R, y2: py(v), stroke: "#eef0f5" }), ns("text", { x: L - 4, y: py(v) + 3, "text-anchor": "end", class: "tick" }, yl(v)));
  }
  const xt = opts.xTicks ? opts.xTicks(x0, x1) : ticks(x0, x1, 4);
  xt.forEach((v) => svg.append(ns("text", { x: px(v), y: H - B + 13, "text-anchor": "middle", class: "tick" }, xl(v))));
  if (opts.xName) svg.append(ns("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis" }, opts.xName));
  if (opts.yName) svg.append(ns("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "axis", transform: `rotate(-90 12 ${(T + H - B) / 2})` }, opts.yName));
  all.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const points = s.xs.map((x, j) => `${px(x).toFixed(1)},${py(s.ys[j]).toFixed(1)}`).join(" ");
    svg.append(ns("polyline", { points, fill: "none", stroke: color, "stroke-width": 1.5, "data-series": s.name, "data-points": s.xs.length }));
    s.xs.forEach((x, j) => svg.append(hover(ns("circle", { cx: px(x), cy: py(s.ys[j]), r: s.xs.length < 60 ? 2.5 : 3, fill: color, "fill-opacity": s.xs.length < 60 ? 1 : 0 }), `${s.name}: ${yl(s.ys[j])} at ${xl(x)}`)));
  });
  if (all.length > 1 || opts.legend) box.append(h("div", { class: "legend" }, all.map((s, i) => h("span", {}, h("i", { style: `background:${COLORS[i % COLORS.length]}` }), s.name))));
  return box;
}

// Grouped bars of each series' shares per bin (so series of different sizes compare): series =
// [{name, counts}], labels = one per bin; hover shows the share and the count.
function bars(title, labels, series, opts = {}) {
  const W = opts.width || 520, H = opts.height || 230, L = 52, R = 12, T = 12, B = 52;
  const svg = ns("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  const box = h("div", { class: "chart", "data-title": title }, h("div", { class: "title" }, title), svg);
  const shares = series.map((s) => { const total = s.counts.reduce((a, b) => a + b, 0) || 1; return s.counts.map((c) => c / total); });
  const top = Math.max(...shares.flat(), 0.01), step = (W - L - R) / labels.length, width = (step * 0.8) / Math.max(series.length, 1);
  const py = (v) => H - B - (v / top) * (H - T - B);
  svg.append(ns("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }));
  for (const v of ticks(0, top, 4)) svg.append(ns("line", { x1: L, y1: py(v), x2: W - R, y2: py(v), stroke: "#eef0f5" }), ns("text", { x: L - 4, y: py(v) + 3, "text-anchor": "end", class: "tick" }, `${fmt.num(100 * v)} %`));
  series.forEach((s, i) => shares[i].forEach((v, j) => svg.append(hover(ns("rect", { x: L + j * step + step * 0.1 + i * width, y: py(v), width: Math.max(width - 1, 1), height: H - B - py(v), fill: COLORS[i % COLORS.length], "data-series": s.name }), `${s.name}, ${labels[j]}: ${fmt.pct(v)} (${fmt.num(Math.round(s.counts[j]))})`))));
  const every = Math.ceil(labels.length / 8);
  labels.forEach((text, j) => { if (j % every === 0) svg.append(ns("text", { x: L + (j + 0.5) * step, y: H - B + 13, "text-anchor": "middle", class: "tick" }, text.length > 14 ? text.slice(0, 13) + "…" : text)); });
  if (opts.xName) svg.append(ns("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "axis" }, opts.xName));
  svg.append(ns("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "axis", transform: `rotate(-90 12 ${(T + H - B) / 2})` }, "share of values"));
  box.append(h("div", { class: "legend" }, series.map((s, i) => h("span", {}, h("i", { style: `background:${COLORS[i % COLORS.length]}` }), s.name))));
  return box;
}

const dayTick = (t) => fmt.time(t).slice(0, 10);

// One feature's charts: its histogram (history, or served, beside what services served), then
// rows, null rate, centre and drift per bucket (a day of history, an hour served).
function featureCharts(f, served) {
  const hist = f.histogram;
  const labels = hist.categories || hist.edges.slice(0, -1).map((e, i) => `${fmt.num(e)} – ${fmt.num(hist.edges[i + 1])}`);
  const series = [{ name: f.source === "history" ? "history (what training reads)" : f.source, counts: hist.values }, ...Object.entries(hist.beside).map(([label, c]) => ({ name: label, counts: c }))];
  const t = f.over_time.map((b) => b.t);
  const timeAxis = f.source === "history" ? { xLabel: dayTick, xName: "event day (UTC)", xTicks: timeTicks } : { xLabel: (v) => fmt.time(v).slice(0, 16), xName: "served (UTC)", xTicks: timeTicks };
  const per = f.source === "history" ? "day" : "hour";
  const charts = [bars(`${f.name}: distribution`, labels, series, { xName: hist.categories ? "value" : "value bin" }),
    chart(`${f.name}: rows per ${per}`, [{ name: "rows", xs: t, ys: f.over_time.map((b) => b.rows) }], { ...timeAxis, yMin: 0, yName: "rows" }),
    chart(`${f.name}: null rate`, [{ name: "null rate", xs: t, ys: f.over_time.map((b) => b.null_rate) }], { ...timeAxis, yMin: 0, yLabel: (v) => `${fmt.num(100 * v)} %`, yName: "nulls" }),
    chart(`${f.name}: drift of each ${per} (PSI against the whole span)`, [{ name: "PSI", xs: t, ys: f.over_time.map((b) => b.psi) }], { ...timeAxis, yMin: 0, yMax: 0.25, yName: "PSI" })];
  if (f.kind === "number") charts.splice(2, 0, chart(`${f.name}: mean and median`, [{ name: "mean", xs: t, ys: f.over_time.map((b) => b.mean) }, { name: "median", xs: t, ys: f.over_time.map((b) => b.median) }], { ...timeAxis, yName: f.name }));
  const s = f.summary;
  const facts = f.kind === "number"
    ? `${fmt.num(s.rows)} rows · ${fmt.pct(s.null_rate)} null · ${fmt.num(s.nans)} NaN · min ${fmt.num(s.min)} · median ${fmt.num(s.quantiles.p50)} · mean ${fmt.num(s.mean)} · stddev ${fmt.num(s.stddev)} · max ${fmt.num(s.max)}`
    : `${fmt.num(s.rows)} rows · ${fmt.pct(s.null_rate)} null · top: ${s.top.slice(0, 5).map(([v, n]) => `${v} (${fmt.num(n)})`).join(", ")}`;
  return h("section", { class: "feature", "data-feature": f.name }, h("h3", {}, h("a", { href: `#/views/${encodeURIComponent(served.view)}/features/${encodeURIComponent(f.name)}` }, f.name)),
    h("p", { class: "muted" }, facts), h("div", { class: "charts" }, charts));
}

function servedCharts(stats) {
  return stats.served.map((s) => {
    const t = s.over_time.map((b) => b.t), axis = { xLabel: (v) => fmt.time(v).slice(0, 16), xName: "served (UTC)", xTicks: timeTicks, yMin: 0, yLabel: (v) => `${fmt.num(100 * v)} %` };
    return h("div", { class: "charts", "data-service": s.service },
      chart(`${s.service}: NOT_FOUND rate`, [{ name: "NOT_FOUND", xs: t, ys: s.over_time.map((b) => b.not_found_rate) }], { ...axis, yName: "NOT_FOUND" }),
      chart(`${s.service}: null rate served`, [{ name: "null", xs: t, ys: s.over_time.map((b) => b.null_rate) }], { ...axis, yName: "nulls" }),
      chart(`${s.service}: lookups per hour`, [{ name: "lookups", xs: t, ys: s.over_time.map((b) => b.lookups) }], { ...axis, yLabel: fmt.num, yName: "lookups" }));
  });
}

function driftTable(stats) {
  const rows = stats.drift.flatMap((r) => r.features.map((f) => h("tr", { class: f.flagged ? "drifted" : "" },
    h("td", {}, r.kind === "view" ? `view ${r.view}` : `service ${r.service}`), h("td", {}, fmt.time(r.checked_at)), h("td", {}, f.name),
    h("td", { class: "num" }, fmt.num(f.psi)), h("td", { class: "num" }, fmt.num(f.js_distance)), h("td", {}, f.flagged ? h("span", { class: "bad" }, `drifted (PSI > ${r.psi_threshold})`) : h("span", { class: "ok" }, "steady")))));
  return rows.length ? table(["report", "checked", "feature", "PSI", "JS distance", ""], rows) : h("p", { class: "muted" }, "No drift report yet (featurestore monitor --view V, or --service S --dataset D).");
}

// ------------------------------------------------------------------ pages

async function catalogPage(params) {
  const data = await api("catalog");
  const q = params.get("q") || "";
  const input = h("input", { type: "search", id: "search", placeholder: "Search views, features, owners, tags…", value: q });
  const results = h("div", {});
  const render = () => {
    const needle = input.value.trim().toLowerCase();
    const match = (o) => !needle || [o.name, o.description, o.owner, ...Object.entries(o.tags || {}).map(([k, v]) => `${k}=${v}`),
      ...(o.features || []).map((f) => (typeof f === "string" ? f : f.name))].join(" ").toLowerCase().includes(needle);
    const views = data.views.filter(match), services = data.services.filter(match);
    const entities = data.entities.filter(match), sources = data.sources.filter(match);
    results.replaceChildren(
      h("h2", {}, `Feature views (${views.length})`),
      table(["view", "entities", "features", "source", "ttl / windows", "owner", "tags", "versions"], views.map((v) =>
        h("tr", { "data-view": v.name },
          h("td", {}, h("a", { href: `#/views/${encodeURIComponent(v.name)}` }, v.name), h("div", { class: "muted" }, v.description)),
          h("td", {}, v.entities.join(", ")),
          h("td", {}, `${v.features.length}: `, v.features.slice(0, 6).flatMap((f, i) => [i ? ", " : "", h("a", { href: `#/views/${encodeURIComponent(v.name)}/features/${encodeURIComponent(f.name)}`, class: "feature-link" }, f.name), " ", h("span", { class: "muted" }, f.dtype)]), v.features.length > 6 ? ", …" : ""),
          h("td", {}, v.source.kind + (v.source.name ? `: ${v.source.name}` : "")),
          h("td", {}, v.ttl_seconds ? `ttl ${fmt.window(v.ttl_seconds)} ` : "", [...new Set(v.features.filter((f) => f.window_seconds).map((f) => fmt.window(f.window_seconds)))].join(" ") || (v.ttl_seconds ? "" : h("span", { class: "muted" }, "no ttl"))),
          h("td", {}, v.owner), h("td", {}, tags(v.tags)), h("td", {}, (v.versions || []).map((n) => `v${n}`).join(" "))))),
      h("h2", {}, `Feature services (${services.length})`),
      table(["service", "features", "owner"], services.map((s) => h("tr", {}, h("td", {}, s.name, h("div", { class: "muted" }, s.description)), h("td", {}, s.features.join(", ")), h("td", {}, s.owner)))),
      h("h2", {}, `Entities (${entities.length})`),
      table(["entity", "join keys", "description"], entities.map((e) => h("tr", {}, h("td", {}, e.name), h("td", {}, Object.entries(e.key_types).map(([k, t]) => `${k}: ${t}`).join(", ")), h("td", {}, e.description)))),
      h("h2", {}, `Push and stream sources (${sources.length})`),
      table(["source", "kind", "fields"], sources.map((s) => h("tr", {}, h("td", {}, s.name), h("td", {}, s.kind), h("td", {}, s.fields.join(", "))))),
    );
  };
  input.addEventListener("input", () => { history.replaceState(null, "", `#/?q=${encodeURIComponent(input.value)}`); render(); });
  render();
  return [h("h1", {}, "Catalogue ", h("span", { class: "muted" }, `registry v${data.project_registry_version}`)), h("div", { class: "toolbar" }, input), results];
}

async function viewPage(name) {
  const data = await api(`views/${encodeURIComponent(name)}`);
  const v = data.view, s = data.status;
  const out = [h("h1", {}, v.name), h("p", {}, v.description || h("span", { class: "muted" }, "no description")),
    h("p", {}, "owner: ", v.owner || "–", " · entities: ", v.entities.join(", ") || "–", " · source: ", v.source.kind, v.source.name ? ` ${v.source.name}` : "", " · ", tags(v.tags))];
  if (s) {
    out.push(h("h2", {}, "Freshness"), h("div", { class: "cards", id: "status" },
      card("newest online event", s.online_age_seconds === null ? "none" : `${fmt.secs(s.online_age_seconds)} ago`),
      card("last materialized", fmt.time(s.last_materialized_at)),
      card("online store", s.online_synced === false ? "behind history: run materialize" : s.online_synced ? "in sync with history" : "–",
           s.online_synced === false ? "bad" : ""),
      card("history rows", fmt.num(s.history_rows)),
      card("Delta version", fmt.num(s.table_version)),
      card("rejected rows", fmt.num(s.rejected_rows), s.rejected_rows ? "bad" : ""),
      ...(s.stream ? s.stream.groups.map((g) => card(`stream ${g.name}`, `${fmt.num(g.lag)} entries behind · ${fmt.num(g.pending)} unacknowledged`)) : [])));
    if (s.online_behind) out.push(h("p", { class: "muted", id: "behind" }, `online store behind history: ${s.online_behind}`));
    if (s.online_error) out.push(h("p", { class: "error" }, s.online_error));
  }
  const stats = v.kind === "feature_view" ? await api(`views/${encodeURIComponent(name)}/statistics?points=200`) : null;
  if (stats && stats.known_after.length) {  // freshness over time, from the history's statistics
    const t = stats.known_after.map((b) => b.t);
    out.push(h("div", { class: "charts", id: "freshness" }, chart("how long after its event time each day's rows were known",
      [{ name: "median", xs: t, ys: stats.known_after.map((b) => b.p50) }, { name: "p99", xs: t, ys: stats.known_after.map((b) => b.p99) }],
      { xLabel: dayTick, xTicks: timeTicks, xName: "event day (UTC)", yLabel: fmt.secs, yName: "known after", yMin: 0, legend: true })));
  }
  out.push(h("h2", {}, "Features"), table(["feature", "type", "aggregation"], v.features.map((f) => h("tr", {},
    h("td", {}, f.name), h("td", {}, f.dtype), h("td", {}, f.function ? `${f.function}(${f.column || "*"}) over ${fmt.window(f.window_seconds)}` : "")))));
  if (stats) {  // (on-demand views keep no history of their own)
    out.push(h("h2", {}, "Values"));
    if (!stats.features.length) out.push(h("p", { class: "muted" }, "No history yet: materialize or push to see what the values are."));
    out.push(...stats.features.map((f) => featureCharts(f, stats)));
    if (stats.served.length) out.push(h("h2", {}, "Served"), ...servedCharts(stats));
    out.push(h("h2", {}, "Drift"), driftTable(stats));
  }
  out.push(h("h2", {}, "Consistency (served vs point-in-time history)"));
  if (!data.consistency.length) out.push(h("p", { class: "muted" }, "No consistency check covers this view yet (featurestore check-consistency)."));
  else {
    const last = data.consistency[data.consistency.length - 1];
    out.push(chart(`match rate over served time: ${last.name}`, [{ name: last.name, xs: last.over_time.map((b) => b.from_us / 1e6), ys: last.over_time.map((b) => b.match) }],
      { yMin: 0, yMax: 1, xLabel: (t) => fmt.time(t).slice(0, 16), xName: "served time (UTC)" }));
    out.push(table(["checked", "check", "read", "vectors", ...Object.keys(last.feature_match)], data.consistency.map((c) =>
      h("tr", {}, h("td", {}, fmt.time(c.checked_at)), h("td", {}, c.name), h("td", {}, c.as_of || "history as of created time"), h("td", {}, fmt.num(c.rows)),
        Object.keys(last.feature_match).map((k) => h("td", {}, fmt.pct(c.feature_match[k])))))));
  }
  out.push(h("p", { class: "muted", id: "hashes" }, `values hash ${fmt.short(v.values_hash)} (what datasets and models record: lineage compares it) · `,
    `definition ${fmt.short(v.hash)} (any edit, description and tags included) · changed in registry versions ${(v.versions || []).join(", ")}`));
  return out;
}

async function featurePage(view, feature) {
  const stats = await api(`views/${encodeURIComponent(view)}/statistics?points=400`);
  const f = stats.features.find((x) => x.name === feature);
  const back = h("p", {}, "feature of view ", h("a", { href: `#/views/${encodeURIComponent(view)}` }, view));
  if (!f) return [h("h1", {}, feature), back, h("p", { class: "muted" }, "No history of this feature yet.")];
  return [h("h1", {}, feature), back, featureCharts(f, stats), h("h2", {}, "Drift"), driftTable({ drift: stats.drift.map((r) => ({ ...r, features: r.features.filter((x) => x.name === feature) })) })];
}

async function runsPage(params) {
  const q = params.get("q") || "";
  const data = await api("runs" + (q ? `?q=${encodeURIComponent(q)}` : ""));
  const chosen = new Set();
  const button = h("button", { id: "compare", disabled: true, onclick: () => { location.hash = `#/compare/${[...chosen].map(encodeURIComponent).join(",")}`; } }, "Compare selected");
  const input = h("input", { type: "search", id: "run-search", placeholder: "Filter by id, tag or service", value: q,
    onchange: () => { location.hash = `#/runs?q=${encodeURIComponent(input.value)}`; } });
  const finals = [...new Set(data.runs.flatMap((r) => Object.keys(r.final)))].filter((k) => k.startsWith("val_")).sort();
  // parameter columns people choose (kept in the address: ?params=config.learning_rate,config.batch_size)
  const paramColumns = (params.get("params") || "").split(",").filter(Boolean);
  const known = [...new Set(data.runs.flatMap((r) => Object.keys(r.params || {})))].sort();
  const columns = h("input", { type: "text", id: "param-columns", list: "param-names", placeholder: "parameter columns: config.learning_rate, …", value: paramColumns.join(","),
    onchange: () => { location.hash = `#/runs?q=${encodeURIComponent(input.value)}&params=${encodeURIComponent(columns.value.replace(/\s/g, ""))}`; } });
  const names = h("datalist", { id: "param-names" }, known.map((k) => h("option", { value: k })));
  return [h("h1", {}, "Runs"), h("div", { class: "toolbar" }, input, columns, names, button),
    table(["", "run", "status", "started", "took", "service", "tags", ...paramColumns, ...finals], data.runs.map((r) => h("tr", { "data-run": r.id },
      h("td", {}, h("input", { type: "checkbox", "data-run": r.id, onchange: (e) => { e.target.checked ? chosen.add(r.id) : chosen.delete(r.id); button.disabled = chosen.size < 2; } })),
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(r.id)}` }, r.id)), h("td", {}, r.status), h("td", {}, r.started_at),
      h("td", { class: "num" }, fmt.duration(r.duration_s)), h("td", {}, r.feature_service || ""), h("td", {}, tags(r.tags)),
      paramColumns.map((k) => h("td", { class: "num", "data-param": k }, fmt.num((r.params || {})[k]))), finals.map((k) => h("td", {}, fmt.num(r.final[k])))))),
    data.runs.length ? null : h("p", { class: "muted" }, "No runs match.")];
}

const X_AXES = { step: "step", epoch: "epoch", samples: "samples seen", wall_time: "seconds since the run started" };

// Each metric's curves, runs overlaid, against the x axis chosen above them (runs with other
// batch sizes compare by samples seen, not by step).
async function curves(runIds, metrics) {
  const box = h("div", { class: "charts" });
  const pick = h("select", { id: "x-axis", onchange: () => draw(pick.value) }, Object.entries(X_AXES).map(([k, label]) => h("option", { value: k }, label)));
  const draw = async (x) => {
    const charts = [];
    for (const metric of metrics) {
      const lines = await Promise.all(runIds.map((id) => api(`runs/${encodeURIComponent(id)}/curve?metric=${encodeURIComponent(metric)}&points=400&x=${x}`).catch((err) => ({ run: id, xs: [], values: [], error: err.message }))));
      const box = chart(metric, lines.map((l) => ({ name: l.run, xs: l.xs, ys: l.values })), { legend: runIds.length > 1, xName: X_AXES[x], xLabel: x === "wall_time" ? fmt.secs : fmt.num });
      lines.filter((l) => l.error).forEach((l) => box.append(h("div", { class: "muted" }, `${l.run}: ${l.error}`)));
      charts.push(box);
    }
    box.replaceChildren(...charts);
    box.dataset.x = x;
  };
  await draw("step");
  return h("div", {}, h("div", { class: "toolbar" }, h("label", { for: "x-axis" }, "x axis "), pick), box);
}

async function runPage(id) {
  const r = await api(`runs/${encodeURIComponent(id)}`);
  return [h("h1", {}, r.id, " ", h("span", { class: "muted" }, r.status)), h("p", {}, tags(r.tags)),
    h("h2", {}, "Final metrics"), table(["metric", "value"], Object.entries(r.final).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, fmt.num(v))))),
    h("h2", {}, "Curves"), await curves([r.id], r.metrics.filter((m) => m !== "epoch")),
    h("h2", {}, "Artifacts (named by SHA-256)"), table(["name", "sha256", "bytes"], Object.entries(r.artifacts).map(([k, a]) =>
      h("tr", {}, h("td", {}, k), h("td", { class: "hash" }, h("a", { href: `api/artifacts/${a.sha256}` }, a.sha256)), h("td", {}, fmt.num(a.bytes))))),
    h("h2", {}, "Parameters"), table(["parameter", "value"], Object.entries(flat(r.params)).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", { class: "hash" }, JSON.stringify(v)))))];
}

function flat(obj, prefix = "") {
  return Object.entries(obj || {}).reduce((out, [k, v]) => (v && typeof v === "object" && !Array.isArray(v) ? Object.assign(out, flat(v, `${prefix}${k}.`)) : Object.assign(out, { [`${prefix}${k}`]: v })), {});
}

async function comparePage(ids) {
  const runs = ids.split(",").map(decodeURIComponent);
  const c = await api("compare?" + runs.map((r) => `runs=${encodeURIComponent(r)}`).join("&"));
  const details = await Promise.all(runs.map((r) => api(`runs/${encodeURIComponent(r)}`)));
  const metrics = [...new Set(details.flatMap((d) => d.metrics))].filter((m) => m !== "epoch").sort();
  const keys = [...c.differs, ...Object.keys(c.params).filter((k) => !c.differs.includes(k))];
  return [h("h1", {}, `Comparing ${runs.length} runs`),
    h("h2", {}, "Final metrics"), table(["metric", ...c.runs], Object.entries(c.final).map(([k, vs]) => h("tr", {}, h("td", {}, k), vs.map((v, i) => h("td", { class: c.best[k] === i ? "num best" : "num", title: c.best[k] === i ? "best" : "" }, fmt.num(v)))))),
    h("h2", {}, "Curves"), await curves(runs, metrics),
    h("h2", {}, `Parameters (${c.differs.length} differ)`), table(["parameter", ...c.runs], keys.map((k) =>
      h("tr", { class: c.differs.includes(k) ? "differs" : "" }, h("td", {}, k), c.params[k].map((v) => h("td", { class: "hash" }, JSON.stringify(v))))))];
}

async function modelsPage() {
  const data = await api("models");
  if (!data.models.length) return [h("h1", {}, "Models"), h("p", { class: "muted" }, "No registered models (featurestore train --register NAME).")];
  return [h("h1", {}, "Models"), ...data.models.map((m) => [h("h2", {}, m.name),
    table(["version", "stages", "metrics", "run", "registered", ""], m.versions.map((v) => h("tr", { "data-model": `${m.name}:${v.version}` },
      h("td", {}, `v${v.version}`), h("td", {}, v.stages.map((s) => h("span", { class: "tag" }, s))),
      h("td", {}, Object.entries(v.metrics || {}).filter(([k]) => k.startsWith("val_")).map(([k, x]) => `${k} ${fmt.num(x)}`).join(" · ")),
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(v.run)}` }, v.run)), h("td", {}, fmt.time(v.registered_at)),
      h("td", {}, h("a", { href: `#/lineage/${encodeURIComponent(m.name)}/${v.version}`, class: "lineage" }, "lineage →")))))])];
}

async function lineagePage(name, version) {
  const l = await api(`models/${encodeURIComponent(name)}/${version}/lineage`);
  const hop = (kind, ...body) => h("div", { class: "hop", "data-hop": kind }, h("div", { class: "kind" }, kind), ...body);
  const d = l.dataset;
  return [h("h1", {}, `Lineage of ${name} v${version}`), h("div", { class: "chain" },
    hop("model", h("b", {}, `${name} v${version}`), " ", l.model.stages.map((s) => h("span", { class: "tag" }, s)),
      h("div", {}, Object.entries(l.model.files).map(([f, sha]) => h("div", { class: "hash" }, `${f}: `, h("a", { href: `api/artifacts/${sha}` }, sha))))),
    hop("training run", l.run.exists ? h("a", { href: `#/runs/${encodeURIComponent(l.run.id)}`, id: "run-link" }, l.run.id) : h("span", { class: "bad" }, `${l.run.id} (deleted)`),
      h("div", { class: "muted" }, `code ${l.run.code_version || l.model.code_version}`)),
    hop("dataset", h("div", {}, d.path || "–", " ", okMark(d.ok)),
      h("div", { class: "hash" }, `manifest ${d.manifest_hash}`), d.exists ? h("div", { class: "muted" }, `${fmt.num(d.rows)} rows, made ${fmt.time(d.created_at)}, registry v${d.registry_version}`) : h("div", { class: "bad" }, "manifest missing")),
    hop("feature definitions", table(["view", "hash trained on", "applied in", "now"], l.definitions.map((x) => h("tr", {},
      h("td", {}, h("a", { href: `#/views/${encodeURIComponent(x.view)}` }, x.view)), h("td", { class: "hash" }, x.hash),
      h("td", {}, x.registry_version ? `registry v${x.registry_version}` : "–"), h("td", {}, x.current ? h("span", { class: "ok" }, "unchanged") : h("span", { class: "bad" }, "changed since")))))),
    hop("Delta tables", table(["view", "table", "version read", "latest"], l.tables.map((t) => h("tr", {},
      h("td", {}, t.view), h("td", {}, t.table), h("td", {}, fmt.num(t.version)), h("td", {}, fmt.num(t.latest_version)))))))];
}

async function consistencyPage() {
  const data = await api("consistency");
  if (!data.checks.length) return [h("h1", {}, "Consistency"), h("p", { class: "muted" }, "No checks recorded yet (featurestore check-consistency).")];
  const byName = {};
  data.checks.forEach((c) => (byName[c.name] = byName[c.name] || []).push(c));
  return [h("h1", {}, "Consistency"), h("div", { class: "charts" }, Object.entries(byName).map(([n, cs]) =>
    chart(`${n}: all features matching, per check`, [{ name: n, xs: cs.map((c) => c.checked_at), ys: cs.map((c) => c.overall) }], { yMin: 0, yMax: 1, xLabel: (t) => fmt.time(t).slice(0, 16), xName: "checked at (UTC)" }))),
    table(["checked", "check", "read", "vectors", "all features", "model score"], data.checks.slice().reverse().map((c) => h("tr", {},
      h("td", {}, fmt.time(c.checked_at)), h("td", {}, c.name), h("td", {}, c.as_of || "history as of created time"), h("td", {}, fmt.num(c.rows)),
      h("td", {}, fmt.pct(c.overall)), h("td", {}, fmt.pct(c.score_match)))))];
}

// ------------------------------------------------------------------ router

// [path, page, nav tab, page name]: once drawn, <main data-page="name"> says which page it shows
const routes = [
  [/^\/views\/([^/]+)\/features\/(.+)$/, (m) => featurePage(decodeURIComponent(m[1]), decodeURIComponent(m[2])), "catalog", "feature"],
  [/^\/views\/(.+)$/, (m) => viewPage(decodeURIComponent(m[1])), "catalog", "view"],
  [/^\/runs\/(.+)$/, (m) => runPage(decodeURIComponent(m[1])), "runs", "run"],
  [/^\/runs$/, (m, p) => runsPage(p), "runs", "runs"],
  [/^\/compare\/(.+)$/, (m) => comparePage(m[1]), "runs", "compare"],
  [/^\/models$/, () => modelsPage(), "models", "models"],
  [/^\/lineage\/([^/]+)\/(\d+)$/, (m) => lineagePage(decodeURIComponent(m[1]), m[2]), "models", "lineage"],
  [/^\/consistency$/, () => consistencyPage(), "consistency", "consistency"],
  [/^\/?$/, (m, p) => catalogPage(p), "catalog", "catalog"],
];

async function route() {
  const [path, query] = (location.hash.slice(1) || "/").split("?");
  const params = new URLSearchParams(query || "");
  const found = routes.find(([re]) => re.test(path));
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", found && a.dataset.nav === found[2]));
  main.setAttribute("aria-busy", "true");
  main.removeAttribute("data-page");
  try {
    const content = found ? await found[1](path.match(found[0]), params) : [h("h1", {}, "Not found")];
    main.replaceChildren(...[content].flat(2).filter(Boolean));
    main.dataset.page = found ? found[3] : "not-found";
  } catch (err) {
    main.replaceChildren(h("p", { class: "error" }, String(err.message || err)));
    main.dataset.page = "error";
  }
  main.removeAttribute("aria-busy");
}

window.addEventListener("hashchange", route);
route();
