// checkpoint-store ui: one page, four views (experiments, trial, checkpoint, parameters)
// and a comparison of trials. Every element is built with the DOM API and every name or
// value from storage goes in as text (never as HTML), so a trial named
// "<img src=x onerror=alert(1)>" shows as exactly that. Names are isolated (<bdi>), so
// a right-to-left override inside one never reorders the text around it.
(function () {
  "use strict";

  const KINDS = {
    best: { label: "kept (best)", color: "#1a9850", style: "star", radius: 11 },
    latest: { label: "kept (latest)", color: "#2166ac", style: "triangle", radius: 9 },
    kept: { label: "kept", color: "#e08214", style: "rectRot", radius: 8 },
    invalid: { label: "committed, invalid", color: "#b2182b", style: "rect", radius: 8 },
    evicted: { label: "reported, then evicted", color: "#888888", style: "crossRot", radius: 7 },
    uncommitted: { label: "not committed (yet)", color: "#d6604d", style: "dash", radius: 8 },
    local: { label: "on the local tier only", color: "#4393c3", style: "circle", radius: 7 },
  };
  // Where a kept checkpoint sorts in the checkpoints table: the ones a user resumes
  // from or ships first, evicted ones last (and hidden unless asked for).
  const KIND_ORDER = { best: 0, latest: 1, kept: 2, local: 3, invalid: 4, uncommitted: 5, evicted: 6 };
  // Ten categorical colours, then hues a golden angle apart at three lightnesses and
  // two saturations: 50 trials get 50 colours, the closest two 32 apart in RGB.
  const BASE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
  const X_AXES = { training_iteration: "report (training_iteration)", time_total_s: "time (s)" };
  const AUTO = new Set(["training_iteration", "timestamp", "time_total_s", "time_this_iter_s"]);
  const STATUSES = ["running", "finished", "pruned", "stopped", "preempted", "errored", "interrupted"];
  // Statuses whose run was ended early and said why (stopped.json): the reason is shown.
  const STOPPED = new Set(["pruned", "stopped", "preempted"]);

  // Read by the browser tests: the current view's data and charts.
  const state = { config: null, timer: null, chart: null, charts: [], view: null, trial: null,
    trials: [], sort: {}, selected: {}, metric: null, panels: [], x: "training_iteration",
    polls: 0, smooth: 0, log: false, robustY: true, zoom: null, showEvicted: false, etags: {},
    filter: { text: "", status: "", group: "" }, overview: null, param: null };
  window.csUI = state;

  // -- small helpers ------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null) continue;
      e.append(c instanceof Node ? c : String(c));
    }
    return e;
  }

  // As the command line's tables (_browse/output.shown): a name with leading or
  // trailing whitespace or a control character shows quoted and escaped, so
  // trial "t1 " never reads as "t1".
  function shown(text) {
    return text === "" || (text === text.trim() && !/[\u0000-\u001f\u007f-\u009f]/.test(text))
      ? text : JSON.stringify(text);
  }

  // A name from storage: isolated from the text around it, cut to the cell's width
  // with the whole name (as it is) on hover.
  function name(text, cls) {
    return el("bdi", { class: cls || "name", title: text }, shown(text));
  }

  function route(...parts) {
    return "#/" + parts.map(encodeURIComponent).join("/");
  }

  function trialColor(i) {
    if (i < BASE.length) return BASE[i];
    // Hues come back near each other every 34 and 55 steps: lightness and saturation
    // cycle on other periods, so such neighbours still differ (_plot.trial_color).
    const hue = (i * 137.508) % 360;
    const light = [50, 32, 66][i % 3];
    return `hsl(${hue.toFixed(3)}, ${[80, 50][Math.floor(i / 3) % 2]}%, ${light}%)`;
  }

  // The raw curve under a smoothed one: the same hue, a third as opaque.
  function faded(color) {
    if (color.startsWith("#")) return color + "55";
    return color.replace(/^hsl\((.*)\)$/, "hsla($1, 0.33)");
  }

  function fmtSize(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, v = n;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
  }

  function fmtTime(ts) {
    if (typeof ts !== "number") return "-";
    const d = new Date(ts * 1000);
    const pad = (x) => String(x).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function fmtValue(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(6)));
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  function query(params) {
    const q = new URLSearchParams(params || {}).toString();
    return q ? "?" + q : "";
  }

  async function api(path, params, init) {
    const resp = await fetch(`api/${path}${query(params)}`, init);
    let body;
    try { body = await resp.json(); } catch (e) { body = { error: resp.statusText }; }
    if (!resp.ok) throw new Error(body.error || `HTTP ${resp.status}`);
    return body;
  }

  // A GET answered 304 while nothing changed: the server's ETag is sent back, so a poll
  // of a finished trial costs a few hundred bytes. Returns {body, changed}.
  async function apiCached(path, params) {
    const key = path + query(params);
    const prev = state.etags[key];
    const headers = prev ? { "If-None-Match": prev.etag } : {};
    const resp = await fetch(`api/${key}`, { headers, cache: "no-store" });
    if (resp.status === 304 && prev) return { body: prev.body, changed: false };
    let body;
    try { body = await resp.json(); } catch (e) { body = { error: resp.statusText }; }
    if (!resp.ok) throw new Error(body.error || `HTTP ${resp.status}`);
    const etag = resp.headers.get("ETag");
    if (etag) state.etags[key] = { etag, body };
    return { body, changed: true };
  }

  function setMain(...children) {
    const main = document.getElementById("main");
    main.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
  }

  function showError(err) {
    setMain(el("p", { class: "error", id: "error" }, err.message || String(err)));
  }

  function statusBadge(status, error) {
    const attrs = { class: `badge status-${status}` };
    if ((status === "errored" || STOPPED.has(status)) && error) {
      attrs.title = status === "preempted" ? `${error}; resumable` : error;
    }
    return el("span", attrs, status);
  }

  // A checkpoint committed on a preemption signal: "preemption (SIGTERM)".
  function preemptionBadge(p, id) {
    if (!p) return null;
    const grace = typeof p.grace_period_s === "number" ? `, grace ${fmtValue(p.grace_period_s)} s` : "";
    return el("span", { class: "badge preemption", id,
      title: `committed on ${p.signal} (signalled at ${fmtTime(p.signalled_at)}${grace})` },
    `preemption (${p.signal})`);
  }

  function breadcrumb(...items) {
    const parts = [el("a", { href: "#/" }, "experiments")];
    for (const [text, href] of items) {
      parts.push(" › ", href ? el("a", { href }, name(text, "crumb")) : name(text, "crumb"));
    }
    return el("nav", { class: "crumbs" }, parts);
  }

  // Make `old` look like `fresh` by changing only what differs, so a text selection
  // (a trial name being copied) or a focused box survives a refresh that changed
  // another row.
  function patch(old, fresh) {
    if (old.isEqualNode(fresh)) return;
    if (old.nodeType !== fresh.nodeType || old.nodeName !== fresh.nodeName ||
        old.childNodes.length !== fresh.childNodes.length || old.nodeType !== 1) {
      old.replaceWith(fresh);
      return;
    }
    for (const a of [...old.attributes]) if (!fresh.hasAttribute(a.name)) old.removeAttribute(a.name);
    for (const a of fresh.attributes) if (old.getAttribute(a.name) !== a.value) old.setAttribute(a.name, a.value);
    if (old.type === "checkbox") old.checked = fresh.checked;
    const olds = [...old.childNodes], news = [...fresh.childNodes];
    news.forEach((n, i) => patch(olds[i], n));
  }

  // -- the experiments table ----------------------------------------------------------

  const COLUMNS = [
    ["trial", "trial"], ["status", "status"], ["reports", "reports"],
    ["committed", "checkpoints"], ["best_score", "best score"],
    ["best_checkpoint", "best checkpoint"], ["size", "size"], ["last_report", "last report"],
  ];

  function cellValue(row, key) {
    return key.startsWith("param:") ? row.params[key.slice(6)] : row[key];
  }

  function compare(a, b) {
    if (a === b) return 0;
    if (a === undefined || a === null) return 1;
    if (b === undefined || b === null) return -1;
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b), undefined, { numeric: true });
  }

  // "lr=0.1 resnet": every word must match; NAME=VALUE a parameter, other words
  // a part of the trial's name (any case).
  function matches(t, filter) {
    if (filter.status && t.status !== filter.status) return false;
    for (const word of filter.text.trim().split(/\s+/).filter(Boolean)) {
      const eq = word.indexOf("=");
      if (eq > 0) {
        const key = word.slice(0, eq), want = word.slice(eq + 1);
        if (!(key in t.params) || fmtValue(t.params[key]) !== want) return false;
      } else if (!t.trial.toLowerCase().includes(word.toLowerCase())) {
        return false;
      }
    }
    return true;
  }

  function sortedTrials(exp) {
    const sort = state.sort[exp.name] || { key: "trial", dir: 1 };
    return exp.trials.filter((t) => matches(t, state.filter)).sort(
      (a, b) => sort.dir * compare(cellValue(a, sort.key), cellValue(b, sort.key)));
  }

  function trialRow(exp, t, cols) {
    const selected = state.selected[exp.name];
    const box = el("input", { type: "checkbox", "aria-label": `select ${t.trial}`,
      checked: selected.has(t.trial),
      onchange: (ev) => { ev.target.checked ? selected.add(t.trial) : selected.delete(t.trial); } });
    const cells = cols.map(([key]) => {
      const v = cellValue(t, key);
      if (key === "trial") return el("td", { class: "name-cell" }, el("a", { href: route("trial", exp.name, t.trial) }, name(t.trial)));
      if (key === "status") return el("td", {}, statusBadge(v, t.error));
      if (key === "size") return el("td", { class: "num", title: `${v} bytes` }, fmtSize(v));
      if (key === "last_report") return el("td", {}, fmtTime(v));
      if (key === "committed") {
        return el("td", { class: "num" }, String(v), t.invalid ? el("span", { class: "error-line" }, ` (${t.invalid} invalid)`) : "");
      }
      if (key === "best_checkpoint") {
        return el("td", {}, v ? el("a", { href: route("checkpoint", exp.name, t.trial, v) }, name(v)) : "-");
      }
      if (typeof v === "string") return el("td", { class: "name-cell" }, name(v));
      return el("td", { class: typeof v === "number" ? "num" : null }, fmtValue(v));
    });
    return el("tr", { "data-trial": t.trial }, el("td", {}, box), cells);
  }

  // A group's trials at a glance: the best of their best scores (by the recorded
  // order) and which trial holds it, their mean, and how many ended in each status.
  function groupAggregate(members, metric) {
    const scored = members.filter((t) => typeof t.best_score === "number");
    const parts = [];
    if (scored.length) {
      const sign = scored.some((t) => t.mode === "min") ? -1 : 1;
      const top = scored.reduce((a, b) => (sign * b.best_score > sign * a.best_score ? b : a));
      const mean = scored.reduce((n, t) => n + t.best_score, 0) / scored.length;
      parts.push(`best ${metric || "score"} ${fmtValue(top.best_score)} (${top.trial}), ` +
        `mean ${fmtValue(mean)}`);
    }
    const counts = {};
    for (const t of members) counts[t.status] = (counts[t.status] || 0) + 1;
    parts.push(STATUSES.filter((st) => counts[st]).map((st) => `${counts[st]} ${st}`).join(", "));
    return el("span", { class: "muted aggregate" }, ` · ${parts.join(" · ")}`);
  }

  function experimentTable(exp) {
    const sort = state.sort[exp.name] || { key: "trial", dir: 1 };
    state.selected[exp.name] = state.selected[exp.name] || new Set();
    const rows = sortedTrials(exp);
    const metric = exp.trials.map((t) => t.metric).find((m) => m) || null;
    const cols = COLUMNS.map(([k, label]) =>
      [k, k === "best_score" && metric ? `best ${metric}` : label]);
    for (const p of exp.params) cols.push([`param:${p}`, p]);

    const head = el("tr", {}, el("th", {}, ""), cols.map(([key, label]) => el("th", {
      class: "sortable" + (sort.key === key ? (sort.dir > 0 ? " asc" : " desc") : ""),
      "data-key": key, title: label,
      onclick: () => {
        const cur = state.sort[exp.name] || { key: "trial", dir: 1 };
        state.sort[exp.name] = { key, dir: cur.key === key ? -cur.dir : 1 };
        renderOverview(state.overview);
      },
    }, name(label, "head"))));
    const group = state.filter.group && exp.params.includes(state.filter.group) ? state.filter.group : "";
    const body = [];
    let last;
    for (const t of group ? rows.slice().sort((a, b) => compare(a.params[group], b.params[group])) : rows) {
      const key = group ? fmtValue(t.params[group]) : null;
      if (group && key !== last) {
        const members = rows.filter((r) => fmtValue(r.params[group]) === key);
        body.push(el("tr", { class: "group" }, el("td", { colspan: cols.length + 1 },
          name(group, "head"), ` = ${key} (${members.length})`, groupAggregate(members, metric))));
        last = key;
      }
      body.push(trialRow(exp, t, cols));
    }
    const compareButton = el("button", { type: "button", class: "compare", onclick: () => {
      const shown = sortedTrials(exp).map((t) => t.trial);
      const names = shown.filter((n) => state.selected[exp.name].has(n));
      location.hash = route("compare", exp.name, ...(names.length ? names : shown));
    } }, "Compare selected trials");
    const links = el("span", { class: "links" },
      el("a", { href: route("params", exp.name), class: "params-link" }, "parameters vs best score"),
      " · ", el("a", { href: `api/csv${query({ experiment: exp.name })}`, class: "csv-best", download: "" },
        "best rows (CSV)"));
    const hidden = exp.trials.length - rows.length;
    return el("section", { class: "experiment", "data-experiment": exp.name },
      el("h2", {}, name(exp.name, "head"), " ", el("span", { class: "muted count" },
        `${rows.length} trial(s)` + (hidden ? `, ${hidden} hidden by the filter` : ""))),
      el("div", { class: "table-wrap" }, el("table", { class: "trials" }, el("thead", {}, head),
        el("tbody", {}, body))),
      el("div", { class: "below-table" }, compareButton, links));
  }

  function toolbar(data) {
    const params = [...new Set(data.experiments.flatMap((e) => e.params))].sort();
    const rerender = () => renderOverview(state.overview);
    return el("div", { class: "controls toolbar", id: "toolbar" },
      el("label", {}, "filter ", el("input", { type: "search", id: "filter", value: state.filter.text,
        placeholder: "name or param=value", oninput: (e) => { state.filter.text = e.target.value; rerender(); } })),
      el("label", {}, "status ", el("select", { id: "status-filter",
        onchange: (e) => { state.filter.status = e.target.value; rerender(); } },
      el("option", { value: "" }, "any"),
      STATUSES.map((s) => el("option", { value: s, selected: s === state.filter.status }, s)))),
      el("label", {}, "group by ", el("select", { id: "group-by",
        onchange: (e) => { state.filter.group = e.target.value; rerender(); } },
      el("option", { value: "" }, "nothing"),
      params.map((p) => el("option", { value: p, selected: p === state.filter.group }, p)))));
  }

  // Directories of trials beside the trials (a stray trial next to experiments
  // makes a storage root read as an experiment): not shown, so named.
  function notWalked(data) {
    const dirs = data.not_walked || [];
    return dirs.length ? el("p", { class: "error", id: "not-walked" },
      "Not shown, holding trials at another depth (a stray trial or trial file here?); " +
      "start `checkpoint-store ui` on each: ",
      dirs.flatMap((u, i) => [i ? ", " : "", el("code", {}, name(u, "uri"))])) : null;
  }

  function renderOverview(data) {
    state.overview = data;
    if (!data.experiments.length) {
      const below = data.stores_below || [];
      setMain(el("p", { class: "muted", id: "empty" }, "No trials under this location yet."),
        below.length ? el("p", { id: "stores-below" },
          "Stores one level down (start `checkpoint-store ui` on one of them): ",
          below.flatMap((u, i) => [i ? ", " : "", el("code", {}, name(u, "uri"))])) : null,
        notWalked(data));
      return;
    }
    const main = document.getElementById("main");
    const sections = data.experiments.map(experimentTable);
    if (!document.getElementById("toolbar")) {
      setMain(toolbar(data), notWalked(data), sections);
      return;
    }
    // Refresh in place: the toolbar keeps its focus, the tables their selections.
    const old = [...main.querySelectorAll("section.experiment")];
    if (old.length !== sections.length ||
        old.some((s, i) => s.dataset.experiment !== sections[i].dataset.experiment)) {
      old.forEach((s) => s.remove());
      main.append(...sections);
      return;
    }
    old.forEach((s, i) => patch(s, sections[i]));
  }

  async function showOverview() {
    const { body, changed } = await apiCached("overview", {});
    if (state.view !== "overview") return;
    if (changed || !document.getElementById("toolbar")) renderOverview(body);
  }

  // -- charts -------------------------------------------------------------------------

  // TensorBoard's smoothing: an exponential moving average, debiased at the start.
  function smoothed(points, weight) {
    let last = 0, n = 0;
    return points.map((p) => {
      n += 1;
      last = last * weight + (1 - weight) * p.y;
      return { x: p.x, y: last / (1 - Math.pow(weight, n)) };
    });
  }

  function markerDataset(label, kind, points, color) {
    const k = KINDS[kind];
    return { type: "scatter", label, kind, data: points, pointStyle: k.style,
      // A star is drawn with lines only: its border is its colour (the trial's in a comparison).
      pointRadius: k.radius, pointHoverRadius: k.radius + 3, borderColor: color || k.color,
      backgroundColor: color || k.color, borderWidth: kind === "best" ? 2.5 : 2, order: 0 };
  }

  // One trial's series as chart datasets: its line (smoothed on top when asked), then one
  // dataset per checkpoint kind. In a comparison the colour says the trial, the shape the kind.
  function trialDatasets(trial, series, color, prefix, kinds) {
    const cps = Object.fromEntries(trial.checkpoints.map((c) => [c.name, c]));
    const line = series.points.map(([x, y]) => ({ x, y }));
    const markers = Object.fromEntries(Object.keys(KINDS).map((k) => [k, []]));
    for (const m of series.markers) {
      const c = cps[m.name] || { kind: "evicted", size: null };
      markers[c.kind].push({ x: m.x, y: m.y, name: m.name, size: c.size, score: c.score,
        rank: c.rank, kind: c.kind, trial: trial.trial, experiment: trial.experiment,
        attribute: trial.metric, preemption: c.preemption || null });
    }
    const many = line.length > 200;
    const sets = [{ type: "line", label: prefix ? trial.trial : series.metric, data: line,
      borderColor: color, backgroundColor: color, pointRadius: many ? 0 : 2,
      pointHitRadius: many ? 0 : 4, borderWidth: state.smooth > 0 ? 1 : 2, tension: 0, order: 1,
      trialName: trial.trial, spanGaps: true,
      ...(state.smooth > 0 ? { borderColor: faded(color) } : {}) }];
    if (state.smooth > 0) {
      sets.push({ type: "line", kind: "smoothed", label: `${prefix ? trial.trial : series.metric} (smoothed)`,
        data: smoothed(line, state.smooth), borderColor: color, backgroundColor: color,
        pointRadius: 0, pointHitRadius: 0, borderWidth: 2, tension: 0, order: 1,
        trialName: trial.trial, inLegend: false });
    }
    for (const kind of kinds) {
      if (markers[kind].length || !prefix) {
        sets.push({ ...markerDataset(KINDS[kind].label, kind, markers[kind], prefix ? color : null),
          trialName: trial.trial });
      }
    }
    return sets;
  }

  function tooltipLabel(ctx, metric) {
    const p = ctx.raw;
    if (p.name) {
      const rank = p.rank ? `, rank ${p.rank}` : "";
      const why = p.attribute && (p.kind === "best" || p.rank)
        ? ` (score ${p.attribute} ${fmtValue(p.score)}${rank})` : "";
      const pre = p.preemption ? `, preemption checkpoint (${p.preemption.signal})` : "";
      return `${p.trial} ${p.name} (${KINDS[p.kind].label}${pre}): ${metric} ${fmtValue(p.y)}${why}, ` +
        `size ${fmtSize(p.size)}`;
    }
    return `${ctx.dataset.label}: ${fmtValue(p.y)} at ${fmtValue(p.x)}`;
  }

  function chartOptions(metric, xKey, compareMode) {
    return {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: true,
      interaction: { mode: "nearest", intersect: true },
      scales: {
        x: { type: "linear", title: { display: true, text: X_AXES[xKey] || xKey },
          ticks: xKey === "training_iteration" ? { precision: 0 } : {},
          min: state.zoom ? state.zoom[0] : undefined, max: state.zoom ? state.zoom[1] : undefined },
        y: { type: state.log ? "logarithmic" : "linear", title: { display: true, text: metric } },
      },
      plugins: {
        // A comparison lists each trial once (its line); one trial lists its markers.
        legend: { position: compareMode ? "right" : "bottom", labels: { usePointStyle: true,
          boxWidth: 10, filter: (item, data) => {
            const d = data.datasets[item.datasetIndex];
            if (d.inLegend === false) return false;
            return compareMode ? d.type === "line" : d.data.length > 0;
          } },
        onHover: compareMode ? (e, item, legend) => highlight(legend.chart, item.text) : undefined,
        onLeave: compareMode ? (e, item, legend) => highlight(legend.chart, null) : undefined },
        tooltip: { callbacks: { label: (ctx) => tooltipLabel(ctx, metric) } },
      },
      onClick: (ev, elements, chart) => {
        for (const e of elements) {
          const p = chart.data.datasets[e.datasetIndex].data[e.index];
          if (p && p.name) {
            location.hash = route("checkpoint", p.experiment, p.trial, p.name);
            return;
          }
        }
      },
    };
  }

  // As TensorBoard's "ignore outliers in chart scaling", by Tukey's far-out fences: the
  // y axis spans the curves' points within 3 interquartile ranges of the middle half,
  // padded by a twentieth, widened to every kept checkpoint's marker. [undefined,
  // undefined] (Chart.js's own range) when no point falls outside, under 5 points, on a
  // log scale, or with the toggle off.
  function quantile(sorted, q) {
    const pos = (sorted.length - 1) * q, lo = Math.floor(pos), hi = Math.ceil(pos);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
  }

  function yRange(datasets) {
    if (!state.robustY || state.log) return [undefined, undefined];
    const ys = datasets.filter((d) => d.type === "line" && d.kind !== "smoothed")
      .flatMap((d) => d.data.map((p) => p.y)).filter(Number.isFinite).sort((a, b) => a - b);
    if (ys.length < 5) return [undefined, undefined];
    const q1 = quantile(ys, 0.25), q3 = quantile(ys, 0.75), iqr = q3 - q1;
    const inside = ys.filter((y) => y >= q1 - 3 * iqr && y <= q3 + 3 * iqr);
    let lo = inside[0], hi = inside[inside.length - 1];
    for (const d of datasets) {
      if (!["best", "latest", "kept"].includes(d.kind)) continue;
      for (const p of d.data) { lo = Math.min(lo, p.y); hi = Math.max(hi, p.y); }
    }
    if (lo <= ys[0] && hi >= ys[ys.length - 1]) return [undefined, undefined];
    const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1;
    return [lo - pad, hi + pad];
  }

  // The y range of yRange; the x axis then keeps every point's x (Chart.js would fit
  // it to the points inside the y range only), and the y ticks stay round numbers.
  // `scales`: a chart's options.scales, or the options of one not built yet (set
  // before it is built, a new chart draws once).
  function applyYRange(scales, datasets) {
    const [lo, hi] = yRange(datasets);
    const { x, y } = scales;
    y.min = lo;
    y.max = hi;
    y.ticks = { ...(y.ticks || {}), includeBounds: lo === undefined };
    if (state.zoom) return;
    const xs = lo === undefined ? [] : datasets.filter((d) => d.type === "line")
      .flatMap((d) => d.data.map((p) => p.x)).filter(Number.isFinite);
    x.min = xs.length ? xs.reduce((a, b) => Math.min(a, b)) : undefined;
    x.max = xs.length ? xs.reduce((a, b) => Math.max(a, b)) : undefined;
  }

  // A new run of the trial (a resume) starts here: a dashed vertical line, drawn by
  // this inline plugin from the datasets' "resumes" ([x, ...] from the series').
  const resumeLines = {
    id: "resumeLines",
    afterDatasetsDraw(chart) {
      const xs = chart.data.datasets.flatMap((d) => d.resumes || []);
      if (!xs.length) return;
      const { ctx, chartArea, scales } = chart;
      ctx.save();
      ctx.strokeStyle = "#6a3d9a"; ctx.lineWidth = 1.5; ctx.setLineDash([6, 4]);
      ctx.fillStyle = "#6a3d9a"; ctx.font = "11px sans-serif";
      for (const x of xs) {
        const px = scales.x.getPixelForValue(x);
        if (px < chartArea.left || px > chartArea.right) continue;
        ctx.beginPath(); ctx.moveTo(px, chartArea.top); ctx.lineTo(px, chartArea.bottom); ctx.stroke();
        ctx.fillText("resumed", px + 3, chartArea.top + 11);
      }
      ctx.restore();
    },
  };

  // Hovering a trial in the legend fades every other trial.
  function highlight(chart, trialName) {
    state.highlighted = trialName;
    for (const d of chart.data.datasets) {
      if (d.baseColor === undefined) {
        d.baseColor = d.borderColor; d.baseWidth = d.borderWidth; d.baseBackground = d.backgroundColor;
      }
      const dim = trialName !== null && d.trialName !== trialName;
      d.borderColor = dim ? "rgba(160,160,160,0.25)" : d.baseColor;
      d.backgroundColor = dim ? "rgba(160,160,160,0.25)" : d.baseBackground;
      d.pointBorderColor = d.borderColor;
      d.pointBackgroundColor = d.backgroundColor;
      d.borderWidth = !dim && trialName !== null && d.type === "line" ? d.baseWidth + 1.5 : d.baseWidth;
    }
    chart.update();  // "none" keeps the points' cached colours
  }

  // Drag across a chart to zoom its x axis (every panel follows), shift-drag to pan,
  // double-click to zoom out. A zoom asks the server for the range at full resolution.
  function zoomable(canvas, box, onZoom) {
    const band = el("div", { class: "zoom-band" });
    box.append(band);
    let start = null, pan = false;
    const scale = () => state.charts.find((c) => c.canvas === canvas)?.scales.x;
    canvas.addEventListener("mousedown", (e) => {
      if (e.button !== 0) return;
      start = e.offsetX; pan = e.shiftKey;
      if (!pan) Object.assign(band.style, { left: `${start}px`, width: "0px", display: "block" });
    });
    canvas.addEventListener("mousemove", (e) => {
      if (start === null || pan) return;
      Object.assign(band.style, { left: `${Math.min(start, e.offsetX)}px`, width: `${Math.abs(e.offsetX - start)}px` });
    });
    window.addEventListener("mouseup", (e) => {
      if (start === null) return;
      band.style.display = "none";
      const sx = scale(), end = e.target === canvas ? e.offsetX : start;
      const from = start; start = null;
      if (!sx || Math.abs(end - from) < 5) return;
      const a = sx.getValueForPixel(from), b = sx.getValueForPixel(end);
      if (pan) {
        const shift = a - b;
        onZoom([sx.min + shift, sx.max + shift]);
      } else {
        onZoom([Math.min(a, b), Math.max(a, b)]);
      }
    });
    canvas.addEventListener("dblclick", () => { if (state.zoom) onZoom(null); });
  }

  function destroyCharts() {
    for (const c of state.charts) c.destroy();
    state.charts = [];
    state.chart = null;
  }

  // `robust`: a curve chart, whose y range ignores outliers when asked (applyYRange).
  function drawChart(canvas, datasets, metric, xKey, compareMode, robust) {
    const old = state.charts.findIndex((c) => c.canvas === canvas);
    if (old >= 0) { state.charts[old].destroy(); state.charts.splice(old, 1); }
    const options = chartOptions(metric, xKey, compareMode);
    if (robust) applyYRange(options.scales, datasets);
    const chart = new Chart(canvas, { type: "scatter", data: { datasets }, options,
      plugins: [resumeLines] });
    state.charts.push(chart);
    state.chart = state.charts.find((c) => c.canvas.id === "chart") || state.charts[0];
    return chart;
  }

  function chartControls(metrics, onChange, { panels = true } = {}) {
    // The user's metrics first; the keys every session fills in apart, below them.
    const user = metrics.filter((m) => !AUTO.has(m)), auto = metrics.filter((m) => AUTO.has(m));
    const option = (m) => el("option", { value: m, selected: m === state.metric }, m);
    const metricSel = el("select", { id: "metric", onchange: (e) => { state.metric = e.target.value; onChange(); } },
      el("optgroup", { label: "your metrics" }, user.map(option)),
      auto.length ? el("optgroup", { label: "auto-filled", class: "auto" }, auto.map(option)) : null);
    // Any reported number can be the x axis (a step, an epoch, samples seen).
    const xKeys = [...Object.keys(X_AXES), ...metrics.filter((m) => !(m in X_AXES))];
    const xSel = el("select", { id: "xaxis", onchange: (e) => { state.x = e.target.value; state.zoom = null; onChange(); } },
      xKeys.map((k) => el("option", { value: k, selected: k === state.x }, X_AXES[k] || k)));
    const robust = el("input", { type: "checkbox", id: "robust-y", checked: state.robustY,
      onchange: (e) => { state.robustY = e.target.checked; onChange(); } });
    const add = panels ? el("select", { id: "add-panel", onchange: (e) => {
      if (e.target.value && !state.panels.includes(e.target.value)) state.panels.push(e.target.value);
      onChange();
    } }, el("option", { value: "" }, "+ another metric…"),
    metrics.filter((m) => m !== state.metric && !state.panels.includes(m)).map((m) => el("option", { value: m }, m))) : null;
    const smooth = el("input", { type: "range", id: "smoothing", min: 0, max: 0.99, step: 0.01,
      value: state.smooth, onchange: (e) => { state.smooth = Number(e.target.value); onChange(); } });
    const log = el("input", { type: "checkbox", id: "log-scale", checked: state.log,
      onchange: (e) => { state.log = e.target.checked; onChange(); } });
    const reset = el("button", { type: "button", id: "reset-zoom", disabled: !state.zoom,
      onclick: () => { state.zoom = null; onChange(); } }, "reset zoom");
    return el("div", { class: "controls", id: "chart-controls" }, el("label", {}, "metric ", metricSel),
      add, el("label", {}, "x axis ", xSel), el("label", {}, "smoothing ", smooth),
      el("label", {}, log, " log scale"),
      el("label", { title: "y axis without the points beyond 3 interquartile ranges (as TensorBoard's " +
        "ignore outliers): one early spike does not flatten the curve; untick to show every point" },
      robust, " ignore outliers"),
      reset,
      el("span", { class: "muted hint" }, "drag to zoom, shift-drag to pan, double-click to zoom out"));
  }

  function defaultMetric(trial) {
    if (state.metric && trial.metrics.includes(state.metric)) return state.metric;
    if (trial.metric && trial.metrics.includes(trial.metric)) return trial.metric;
    return trial.metrics.find((m) => !AUTO.has(m)) || trial.metrics[0] || null;
  }

  function seriesParams(t, metric) {
    const p = { experiment: t.experiment, trial: t.trial, metric, x: state.x };
    if (state.zoom) { p.x_min = state.zoom[0]; p.x_max = state.zoom[1]; }
    return p;
  }

  async function fetchSeries(t, metric) {
    return (await apiCached("series", seriesParams(t, metric))).body;
  }

  // -- a trial ------------------------------------------------------------------------

  function checkpointRows(trial) {
    return trial.checkpoints.slice().sort((a, b) => (KIND_ORDER[a.kind] - KIND_ORDER[b.kind]) ||
      ((a.rank || 1e12) - (b.rank || 1e12)) || ((b.index || 0) - (a.index || 0)));
  }

  // "kept (best)" for the best one, "kept (top 2)" for the others retention keeps by
  // score, then ", latest" where the newest is also kept for another reason.
  function kindLabel(c) {
    let label = KINDS[c.kind].label;
    if (c.kind === "best" && !c.is_best) label = c.rank ? `kept (top ${c.rank})` : "kept (by score)";
    return label + (c.is_latest && c.kind !== "latest" ? ", latest" : "");
  }

  // The run's parameters (params.json, nested keys joined by "/").
  function paramsTable(t) {
    const keys = Object.keys(t.params || {}).sort();
    if (!keys.length) return el("p", { class: "muted", id: "params" }, "No parameters recorded (params.json).");
    return el("table", { class: "params", id: "params" },
      el("tbody", {}, keys.map((k) => el("tr", { "data-param": k }, el("th", {}, name(k, "head")),
        el("td", { class: typeof t.params[k] === "number" ? "num" : null }, fmtValue(t.params[k]))))));
  }

  function checkpointTable(trial) {
    const metric = trial.metric;
    const rows = checkpointRows(trial);
    const evicted = rows.filter((c) => c.kind === "evicted").length;
    const shown = state.showEvicted ? rows : rows.filter((c) => c.kind !== "evicted");
    const toggle = el("label", { class: "muted" }, el("input", { type: "checkbox", id: "show-evicted",
      checked: state.showEvicted, onchange: (e) => {
        state.showEvicted = e.target.checked;
        document.getElementById("checkpoints-box").replaceWith(checkpointTable(state.trial));
      } }), ` show ${evicted} evicted`);
    // With a local tier: on which tiers each one is committed, and its durable copy.
    const tiered = rows.some((c) => c.tiers);
    const tiersCell = (c) => el("td", { class: "tiers" }, (c.tiers || []).join(", ") || "-",
      c.durable && c.durable !== "committed" ? el("span", { class: "muted" }, ` (durable: ${c.durable})`) : "");
    return el("div", { id: "checkpoints-box" }, toggle,
      el("table", { class: "checkpoints", id: "checkpoints" },
        el("thead", {}, el("tr", {}, ["checkpoint", "kind", "rank", metric ? metric : "score",
          "report", "size", "files", "created", ...(tiered ? ["tiers"] : [])].map((h) => el("th", {}, h)))),
        el("tbody", {}, shown.map((c) => el("tr", { "data-checkpoint": c.name, "data-kind": c.kind,
          title: c.reason || null },
        el("td", {}, el("a", { href: route("checkpoint", trial.experiment, trial.trial, c.name) }, name(c.name))),
        el("td", {}, el("span", { class: `badge kind-${c.kind}` }, kindLabel(c)),
        c.preemption ? " " : null, preemptionBadge(c.preemption)),
        el("td", { class: "num" }, fmtValue(c.rank)),
        el("td", { class: "num" }, fmtValue(c.score)),
        el("td", { class: "num" }, fmtValue(c.iteration)),
        el("td", { class: "num" }, fmtSize(c.size)),
        el("td", { class: "num" }, fmtValue(c.files)),
        el("td", {}, fmtTime(c.created_at)),
        tiered ? tiersCell(c) : null)))));
  }

  function trialSummary(t) {
    const best = t.best_checkpoint
      ? el("span", {}, `best ${t.metric} ${fmtValue(t.best_score)} at `,
        el("a", { href: route("checkpoint", t.experiment, t.trial, t.best_checkpoint) }, name(t.best_checkpoint)))
      : el("span", {}, "no score attribute recorded");
    const error = (t.status === "errored" || STOPPED.has(t.status)) && t.error
      ? el("span", { class: "error-line", id: "reason" },
        ` (${t.status === "errored" ? "last run raised " : t.status === "preempted" ? "preempted: " : ""}${t.error}) `) : "";
    // A preempted run committed what it could: a new run resumes from the newest checkpoint.
    const latest = (t.checkpoints || []).find((c) => c.is_latest);
    const resume = t.status === "preempted"
      ? el("span", { class: "resumable", id: "resumable" }, "resumable",
        latest ? [" from ", el("a", { href: route("checkpoint", t.experiment, t.trial, latest.name) },
          name(latest.name))] : " (no committed checkpoint: a new run starts over)", "; ") : "";
    const invalid = t.invalid ? el("span", { class: "error-line" }, ` ${t.invalid} invalid;`) : "";
    return el("p", { class: "summary", id: "summary" }, statusBadge(t.status, t.error), error, resume,
      ` ${t.total_rows} report(s), ${t.committed} committed checkpoint(s),`, invalid,
      ` ${fmtSize(t.size)}; `, best, " · ",
      el("a", { href: `api/csv${query({ experiment: t.experiment, trial: t.trial })}`, id: "csv", download: "" },
        "rows as CSV"));
  }

  async function drawTrialCharts(t) {
    const metrics = [state.metric, ...state.panels.filter((m) => m !== state.metric)];
    const all = await Promise.all(metrics.map((m) => fetchSeries(t, m)));
    if (state.view !== "trial" || state.trial.trial !== t.trial) return;
    const box = document.getElementById("panels");
    const have = new Map([...box.querySelectorAll("canvas")].map((c) => [c.dataset.metric, c]));
    for (const [m, canvas] of have) {
      if (!metrics.includes(m)) {
        const i = state.charts.findIndex((c) => c.canvas === canvas);
        if (i >= 0) { state.charts[i].destroy(); state.charts.splice(i, 1); }
        canvas.closest(".chart-box").remove();
      }
    }
    metrics.forEach((m, i) => {
      let canvas = have.get(m);
      if (!canvas) {
        canvas = el("canvas", { id: i === 0 ? "chart" : `chart-${i}`, "data-metric": m });
        const close = i === 0 ? null : el("button", { type: "button", class: "close-panel",
          title: `remove the ${m} chart`, onclick: () => {
            state.panels = state.panels.filter((p) => p !== m); drawTrialCharts(state.trial);
          } }, "×");
        const chartBox = el("div", { class: "chart-box" + (i ? " small" : "") }, canvas, close);
        box.append(chartBox);
        zoomable(canvas, chartBox, (range) => { state.zoom = range; renderTrialCharts(); });
      }
      const sets = trialDatasets(t, all[i], BASE[0], "", Object.keys(KINDS));
      sets[0].resumes = (all[i].resumes || []).map((r) => r.x);
      const chart = state.charts.find((c) => c.canvas === canvas);
      if (chart && chart.options.scales.y.type === (state.log ? "logarithmic" : "linear")) {
        chart.data.datasets = sets;
        chart.options.scales.x.min = state.zoom ? state.zoom[0] : undefined;
        chart.options.scales.x.max = state.zoom ? state.zoom[1] : undefined;
        chart.options.scales.x.title.text = X_AXES[state.x] || state.x;
        chart.options.scales.x.ticks = state.x === "training_iteration" ? { precision: 0 } : {};
        applyYRange(chart.options.scales, sets);
        chart.update("none");
      } else {
        drawChart(canvas, sets, m, state.x, false, true);
      }
    });
    state.chart = state.charts.find((c) => c.canvas.id === "chart") || null;
  }

  function renderTrialCharts() {
    const controls = document.getElementById("chart-controls");
    if (controls) controls.replaceWith(chartControls(state.trial.metrics, renderTrialCharts));
    return drawTrialCharts(state.trial);
  }

  function renderTrial() {
    const t = state.trial;
    state.metric = defaultMetric(t);
    setMain(breadcrumb([t.experiment, null], [t.trial, null]),
      el("h1", {}, name(t.trial, "title")),
      el("p", { class: "muted uri" }, t.uri),
      trialSummary(t),
      el("details", { class: "params-box", open: true }, el("summary", {}, "Parameters"), paramsTable(t)),
      chartControls(t.metrics, renderTrialCharts),
      el("div", { id: "panels" }),
      el("h2", {}, "Checkpoints"), checkpointTable(t));
    if (state.metric) return drawTrialCharts(t);
    return null;
  }

  async function showTrial(experiment, trial) {
    state.trial = (await apiCached("trial", { experiment, trial })).body;
    state.zoom = null;
    await renderTrial();
  }

  async function pollTrial() {
    const t = state.trial;
    const { body, changed } = await apiCached("trial", { experiment: t.experiment, trial: t.trial });
    if (!changed || state.view !== "trial" || state.trial !== t) return;
    state.trial = body;
    document.getElementById("summary").replaceWith(trialSummary(body));
    document.getElementById("checkpoints-box").replaceWith(checkpointTable(body));
    if (!state.metric) { await renderTrial(); return; }
    await drawTrialCharts(body);
  }

  // -- several trials -----------------------------------------------------------------

  async function drawCompare() {
    const trials = state.trials;
    const all = await Promise.all(trials.map((t) => fetchSeries(t, state.metric)));
    if (state.view !== "compare") return;
    const sets = trials.flatMap((t, i) => trialDatasets(t, all[i], trialColor(i), `${t.trial}: `,
      ["best", "latest", "kept"]));
    const chart = state.chart;
    if (chart && chart.options.scales.y.type === (state.log ? "logarithmic" : "linear") &&
        chart.options.scales.y.title.text === state.metric &&
        chart.options.scales.x.title.text === (X_AXES[state.x] || state.x)) {
      chart.data.datasets = sets;
      chart.options.scales.x.min = state.zoom ? state.zoom[0] : undefined;
      chart.options.scales.x.max = state.zoom ? state.zoom[1] : undefined;
      applyYRange(chart.options.scales, sets);
      chart.update("none");
      if (state.highlighted) highlight(chart, state.highlighted);
    } else {
      drawChart(document.getElementById("chart"), sets, state.metric, state.x, true, true);
    }
  }

  function renderCompareControls() {
    const metrics = [...new Set(state.trials.flatMap((t) => t.metrics))];
    document.getElementById("chart-controls").replaceWith(
      chartControls(metrics, () => { renderCompareControls(); drawCompare(); }, { panels: false }));
  }

  async function showCompare(experiment, names) {
    const trials = await Promise.all(names.map(async (trial) =>
      (await apiCached("trial", { experiment, trial })).body));
    state.trials = trials;
    state.zoom = null;
    const metrics = [...new Set(trials.flatMap((t) => t.metrics))];
    state.metric = defaultMetric({ metrics, metric: trials.map((t) => t.metric).find((m) => m) });
    const canvas = el("canvas", { id: "chart" });
    const chartBox = el("div", { class: "chart-box tall" }, canvas);
    setMain(breadcrumb([experiment, null], ["compare", null]),
      el("h1", {}, name(experiment, "title"), `: ${trials.length} trial(s)`),
      el("p", { class: "muted" }, "Curves of each trial, one colour each; markers are the checkpoints " +
        "each one keeps (star: best, triangle: latest). Hover a trial in the legend to bring it forward."),
      el("div", { id: "chart-controls" }),
      chartBox);
    renderCompareControls();
    zoomable(canvas, chartBox, (range) => { state.zoom = range; renderCompareControls(); drawCompare(); });
    if (state.metric) await drawCompare();
  }

  async function pollCompare() {
    const answers = await Promise.all(state.trials.map((t) =>
      apiCached("trial", { experiment: t.experiment, trial: t.trial })));
    if (state.view !== "compare" || !answers.some((a) => a.changed)) return;
    state.trials = answers.map((a) => a.body);
    await drawCompare();
  }

  // -- parameters against the best score ----------------------------------------------

  async function showParams(experiment) {
    const data = (await apiCached("overview", {})).body;
    const exp = data.experiments.find((e) => e.name === experiment);
    if (!exp) throw new Error(`no experiment ${JSON.stringify(experiment)} under this location`);
    const metric = exp.trials.map((t) => t.metric).find((m) => m) || "best score";
    if (!state.param || !exp.params.includes(state.param)) state.param = exp.params[0] || null;
    const canvas = el("canvas", { id: "chart" });
    const draw = () => {
      const trials = exp.trials.filter((t) => typeof t.best_score === "number" && state.param in t.params);
      const values = trials.map((t) => t.params[state.param]);
      const numeric = values.every((v) => typeof v === "number");
      const cats = numeric ? [] : [...new Set(values.map(fmtValue))].sort(compare);
      const points = trials.map((t, i) => ({ x: numeric ? values[i] : cats.indexOf(fmtValue(values[i])),
        y: t.best_score, trial: t.trial, value: values[i], checkpoint: t.best_checkpoint }));
      const positive = numeric && values.length > 0 && values.every((v) => v > 0);
      const logX = positive && Math.max(...values) / Math.min(...values) >= 100;
      drawChart(canvas, [{ type: "scatter", label: `${metric} by ${state.param}`, data: points,
        pointRadius: 6, pointHoverRadius: 9, backgroundColor: BASE[0], borderColor: BASE[0] }],
      metric, state.param, false);
      const chart = state.chart;
      chart.options.scales.x = { type: logX ? "logarithmic" : "linear",
        title: { display: true, text: state.param },
        ticks: numeric ? {} : { stepSize: 1, callback: (v) => cats[v] ?? "" } };
      chart.options.plugins.legend.display = false;
      chart.options.plugins.tooltip.callbacks.label = (ctx) =>
        `${ctx.raw.trial}: ${state.param} ${fmtValue(ctx.raw.value)}, best ${metric} ${fmtValue(ctx.raw.y)}`;
      chart.options.onClick = (ev, elements) => {
        const p = elements.length ? points[elements[0].index] : null;
        if (p) location.hash = route("trial", experiment, p.trial);
      };
      chart.update("none");
    };
    const sel = el("select", { id: "param", onchange: (e) => { state.param = e.target.value; draw(); } },
      exp.params.map((p) => el("option", { value: p, selected: p === state.param }, p)));
    setMain(breadcrumb([experiment, null], ["parameters", null]),
      el("h1", {}, name(experiment, "title"), `: best ${metric} by parameter`),
      el("p", { class: "muted" }, "One point per trial: a parameter's value against the trial's best score. " +
        "Click a point to open the trial."),
      exp.params.length ? el("div", { class: "controls" }, el("label", {}, "parameter ", sel))
        : el("p", { class: "muted" }, "No trial of this experiment records parameters (params.json)."),
      el("div", { class: "chart-box" }, canvas));
    if (state.param) draw();
  }

  // -- a checkpoint -------------------------------------------------------------------

  function jsonBlock(id, value) {
    return el("pre", { class: "json", id }, JSON.stringify(value, null, 2));
  }

  function snippet(id, text) {
    const pre = el("pre", { class: "snippet", id }, text);
    const button = el("button", { type: "button", class: "copy", onclick: async () => {
      try { await navigator.clipboard.writeText(text); button.textContent = "copied"; }
      catch (e) { window.getSelection().selectAllChildren(pre); button.textContent = "selected: press Ctrl+C"; }
    } }, "copy");
    return el("div", { class: "snippet-box" }, pre, button);
  }

  async function verify(c, out, button) {
    button.disabled = true;
    out.className = "verify running";
    out.textContent = "verifying: reading every file…";
    try {
      const r = await api("verify", {}, { method: "POST",
        headers: { "Content-Type": "application/json", "X-Checkpoint-Store": "verify" },
        body: JSON.stringify({ experiment: c.experiment, trial: c.trial, checkpoint: c.name }) });
      out.className = r.ok ? "verify ok" : "verify fail";
      out.textContent = r.ok
        ? `OK: ${r.files} file(s), ${fmtSize(r.bytes)} match the manifest (size and CRC32C) in ${r.seconds} s`
        : `FAILED${r.file ? ` (${r.file})` : ""}: ${r.error}`;
      if (r.file) out.dataset.file = r.file;
    } catch (err) {
      out.className = "verify fail";
      out.textContent = `error: ${err.message}`;
    } finally {
      button.disabled = false;
    }
  }

  function retentionLine(c) {
    if (!c.kind) return null;
    const parts = [el("span", { class: `badge kind-${c.kind}`, id: "kind" }, KINDS[c.kind].label)];
    if (c.score_attribute) {
      parts.push(` ${c.score_attribute} ${fmtValue(c.score)}`);
      parts.push(c.rank ? `, rank ${c.rank} of ${c.ranked}` : ", not ranked");
    }
    if (c.is_latest) parts.push(" · the newest committed checkpoint (a resume starts here)");
    if (c.preemption) {
      parts.push(" · ", preemptionBadge(c.preemption, "preemption"),
        ` committed on ${c.preemption.signal} at ${fmtTime(c.preemption.signalled_at)}, ` +
        "whatever the retention and persist policies said");
    }
    return el("p", { class: "summary", id: "retention" }, parts);
  }

  // A state's tensors, one row each, with a filter over the names (a glob-free
  // substring, any case; the load_state snippet takes globs).
  function tensorTable(tensors) {
    const total = tensors.reduce((n, t) => n + (t.size || 0), 0);
    const rows = tensors.map((t) => el("tr", { "data-tensor": t.name },
      el("td", { class: "name-cell" }, name(t.name)), el("td", {}, t.dtype || "-"),
      el("td", { class: "mono" }, `[${(t.shape || []).join(", ")}]`),
      el("td", { class: "num", title: `${t.size} bytes` }, fmtSize(t.size)),
      el("td", {}, t.alias_of ? el("span", { class: "muted" }, `alias of ${t.alias_of}`) : name(t.file || "-"))));
    const count = el("span", { class: "muted", id: "tensor-count" }, `${tensors.length} shown`);
    const filter = el("input", { type: "search", id: "tensor-filter", placeholder: "filter tensor names",
      oninput: (e) => {
        const want = e.target.value.trim().toLowerCase();
        let n = 0;
        for (const tr of rows) {
          const show = tr.dataset.tensor.toLowerCase().includes(want);
          tr.hidden = !show; n += show ? 1 : 0;
        }
        count.textContent = `${n} shown`;
      } });
    return [el("h2", {}, `State: ${tensors.length} tensor(s), ${fmtSize(total)}`),
      el("div", { class: "controls" }, el("label", {}, "filter ", filter), count),
      el("div", { class: "table-wrap" }, el("table", { id: "tensors", class: "manifest" },
        el("thead", {}, el("tr", {}, ["tensor", "dtype", "shape", "size", "file"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows)))];
  }

  // A checkpoint retention deleted: when, why, and what it kept instead.
  function showEvicted(c) {
    const back = route("trial", c.experiment, c.trial);
    const at = c.evicted_at;
    setMain(breadcrumb([c.experiment, null], [c.trial, back], [c.name, null]),
      el("h1", {}, name(c.name, "title")),
      el("p", { class: "muted uri" }, c.uri),
      el("p", { class: "summary", id: "evicted" },
        el("span", { class: "badge kind-evicted" }, KINDS.evicted.label), " ",
        `reported at ${fmtTime(c.reported.timestamp)} (report ${fmtValue(c.reported.iteration)})`,
        c.score_attribute ? `, ${c.score_attribute} ${fmtValue(c.score)}` : "", "; ",
        at ? `evicted after report ${fmtValue(at.iteration)} (${fmtTime(at.timestamp)}), when ${at.by} was reported` :
          "its directory is gone"),
      el("p", { id: "evicted-reason" }, `Why: ${c.reason}.`),
      c.kept_instead.length ? el("div", {}, el("h2", {}, "Kept instead"),
        el("ul", { id: "kept-instead" }, c.kept_instead.map((k) => el("li", {},
          el("a", { href: route("checkpoint", c.experiment, c.trial, k.name) }, name(k.name)),
          k.why.length ? ` (${k.why.join(", ")})` : "")))) : null,
      el("p", {}, el("a", { href: back, id: "back" }, `back to ${c.trial}`)));
  }

  async function showCheckpoint(experiment, trial, cname) {
    const c = await api("checkpoint", { experiment, trial, checkpoint: cname });
    if (c.state === "evicted") { showEvicted(c); return; }
    const out = el("div", { id: "verify-result", class: "verify" });
    const button = el("button", { type: "button", id: "verify", onclick: () => verify(c, out, button) },
      "Verify");
    const state_ = c.state === "committed" ? null
      : el("p", { class: "error" }, `${c.state}${c.file ? ` (${c.file})` : ""}: ${c.reason || "not committed"}`);
    setMain(breadcrumb([experiment, null], [trial, route("trial", experiment, trial)], [cname, null]),
      el("h1", {}, name(cname, "title")),
      el("p", { class: "muted uri" }, c.uri),
      retentionLine(c),
      state_,
      el("div", { class: "verify-row" }, button, out),
      el("h2", {}, `Manifest: ${c.manifest.length} file(s), ${fmtSize(c.size)}`),
      el("table", { id: "manifest", class: "manifest" },
        el("thead", {}, el("tr", {}, el("th", {}, "file"), el("th", {}, "size"), el("th", {}, "CRC32C"))),
        el("tbody", {}, c.manifest.map((f) => el("tr", {}, el("td", {}, f.path),
          el("td", { class: "num" }, fmtSize(f.size)), el("td", { class: "mono" }, f.crc32c || "-"))))),
      c.tensors ? tensorTable(c.tensors) : null,
      el("h2", {}, c.tensors ? "Download or load" : "Download or resume"),
      snippet("snippet-shell", c.snippets.shell),
      snippet("snippet-python", c.snippets.python),
      el("div", { class: "columns" },
        el("div", {}, el("h2", {}, "User metadata"), jsonBlock("user-metadata", c.user_metadata)),
        el("div", {}, el("h2", {}, "Internal metadata"), jsonBlock("internal-metadata", c.internal_metadata))));
  }

  // -- routing and live refresh ---------------------------------------------------------

  async function onRoute() {
    destroyCharts();
    const parts = location.hash.replace(/^#\/?/, "").split("/").filter((p) => p !== "")
      .map(decodeURIComponent);
    const [view, ...args] = parts;
    state.view = view || "overview";
    try {
      if (!view) { document.getElementById("main").replaceChildren(); await showOverview(); }
      else if (view === "trial" && args.length === 2) await showTrial(args[0], args[1]);
      else if (view === "compare" && args.length >= 2) await showCompare(args[0], args.slice(1));
      else if (view === "params" && args.length === 1) await showParams(args[0]);
      else if (view === "checkpoint" && args.length === 3) await showCheckpoint(...args);
      else throw new Error("unknown page: " + location.hash);
    } catch (err) {
      showError(err);
    }
  }

  function setLive(text, stale) {
    const live = document.getElementById("live");
    live.textContent = text;
    live.title = text;
    live.classList.toggle("stale", stale);
  }

  async function poll() {
    if (state.busy) return;  // a slow storage: never stack polls
    state.busy = true;
    try {
      if (state.view === "overview") await showOverview();
      else if (state.view === "trial" && state.trial) await pollTrial();
      else if (state.view === "compare" && state.trials.length) await pollCompare();
      state.polls += 1;
      setLive(`live · ${new Date().toLocaleTimeString()}`, false);
    } catch (err) {
      setLive(`not refreshed: ${err.message}`, true);
    } finally {
      state.busy = false;
    }
  }

  async function start() {
    try {
      state.config = await api("config");
    } catch (err) {
      showError(err);
      return;
    }
    const loc = document.getElementById("location");
    loc.textContent = state.config.uri;
    loc.title = state.config.uri;
    window.addEventListener("hashchange", onRoute);
    await onRoute();
    state.timer = setInterval(poll, state.config.refresh_ms);
  }

  start();
})();
