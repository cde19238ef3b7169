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

async function api(path) {
  const response = await fetch("api/" + path, { headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.detail || `${response.status} ${response.statusText}`);
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

// A line chart as SVG: series = [{name, xs, ys}], drawn as polylines on shared axes.
function chart(title, series, opts = {}) {
  const W = opts.width || 520, H = opts.height || 220, L = 52, R = 10, T = 10, B = 26;
  const all = series.filter((s) => s.xs.length);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const box = h("div", { class: "chart", "data-title": title }, h("div", { class: "title" }, title), svg);
  if (!all.length) { box.append(h("div", { class: "muted" }, "no points")); return box; }
  const xs = all.flatMap((s) => s.xs), ys = all.flatMap((s) => s.ys);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (opts.yMin !== undefined) y0 = Math.min(y0, opts.yMin);
  if (opts.yMax !== undefined) y1 = Math.max(y1, opts.yMax);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + 1;
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), py = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const ns = (tag, attrs) => { const e = document.createElementNS("http://www.w3.org/2000/svg", tag); for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); return e; };
  svg.append(ns("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccd" }), ns("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#ccd" }));
  const label = (x, y, text, anchor) => { const t = ns("text", { x, y, "text-anchor": anchor }); t.textContent = text; svg.append(t); };
  const xl = opts.xLabel || ((v) => fmt.num(v));
  label(L, H - 8, xl(x0), "start"); label(W - R, H - 8, xl(x1), "end");
  label(L - 4, H - B, fmt.num(y0), "end"); label(L - 4, T + 8, fmt.num(y1), "end");
  if (opts.xName) label((L + W - R) / 2, H - 8, opts.xName, "middle");  // the axis says what it counts
  all.forEach((s, i) => {
    const points = s.xs.map((x, j) => `${px(x).toFixed(1)},${py(s.ys[j]).toFixed(1)}`).join(" ");
    svg.append(ns("polyline", { points, fill: "none", stroke: COLORS[i % COLORS.length], "stroke-width": 1.5, "data-series": s.name, "data-points": s.xs.length }));
    if (s.xs.length < 40) s.xs.forEach((x, j) => svg.append(ns("circle", { cx: px(x), cy: py(s.ys[j]), r: 2.5, fill: COLORS[i % COLORS.length] })));
  });
  if (all.length > 1 || opts.legend) box.append(h("div", { class: "legend" }, all.map((s, i) => h("span", {}, h("i", { style: `background:${COLORS[i % COLORS.length]}` }), s.name))));
  return box;
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
          h("td", {}, `${v.features.length}: `, v.features.slice(0, 6).flatMap((f, i) => [i ? ", " : "", f.name, " ", h("span", { class: "muted" }, f.dtype)]), v.features.length > 6 ? ", …" : ""),
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
    if (s.online_error) out.push(h("p", { class: "error" }, s.online_error));
  }
  out.push(h("h2", {}, "Features"), table(["feature", "type", "aggregation"], v.features.map((f) => h("tr", {},
    h("td", {}, f.name), h("td", {}, f.dtype), h("td", {}, f.function ? `${f.function}(${f.column || "*"}) over ${fmt.window(f.window_seconds)}` : "")))));
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

async function runsPage(params) {
  const q = params.get("q") || "";
  const data = await api("runs" + (q ? `?q=${encodeURIComponent(q)}` : ""));
  const chosen = new Set();
  const button = h("button", { id: "compare", disabled: true, onclick: () => { location.hash = `#/compare/${[...chosen].map(encodeURIComponent).join(",")}`; } }, "Compare selected");
  const input = h("input", { type: "search", id: "run-search", placeholder: "Filter by id, tag or service", value: q,
    onchange: () => { location.hash = `#/runs?q=${encodeURIComponent(input.value)}`; } });
  const finals = [...new Set(data.runs.flatMap((r) => Object.keys(r.final)))].filter((k) => k.startsWith("val_")).sort();
  return [h("h1", {}, "Runs"), h("div", { class: "toolbar" }, input, button),
    table(["", "run", "status", "started", "took", "service", "tags", ...finals], data.runs.map((r) => h("tr", { "data-run": r.id },
      h("td", {}, h("input", { type: "checkbox", "data-run": r.id, onchange: (e) => { e.target.checked ? chosen.add(r.id) : chosen.delete(r.id); button.disabled = chosen.size < 2; } })),
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(r.id)}` }, r.id)), h("td", {}, r.status), h("td", {}, r.started_at),
      h("td", { class: "num" }, fmt.duration(r.duration_s)), h("td", {}, r.feature_service || ""), h("td", {}, tags(r.tags)), finals.map((k) => h("td", {}, fmt.num(r.final[k])))))),
    data.runs.length ? null : h("p", { class: "muted" }, "No runs match.")];
}

async function curves(runIds, metrics) {
  const charts = [];
  for (const metric of metrics) {
    const lines = await Promise.all(runIds.map((id) => api(`runs/${encodeURIComponent(id)}/curve?metric=${encodeURIComponent(metric)}&points=400`)));
    charts.push(chart(metric, lines.map((l) => ({ name: l.run, xs: l.steps, ys: l.values })), { legend: runIds.length > 1, xName: "step" }));
  }
  return h("div", { class: "charts" }, charts);
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
