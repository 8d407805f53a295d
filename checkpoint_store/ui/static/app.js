// checkpoint-store ui: one page, three views (experiments, trial, checkpoint) and a
// comparison of trials. Every element is built with the DOM API and every name or
// value from storage goes in as text (never as HTML), so a trial named
// "<img src=x onerror=alert(1)>" shows as exactly that.
(function () {
  "use strict";

  const KINDS = {
    best: { label: "kept (best)", color: "#1a9850", style: "star", radius: 11 },
    latest: { label: "kept (latest)", color: "#2166ac", style: "triangle", radius: 9 },
    kept: { label: "kept", color: "#e08214", style: "rectRot", radius: 8 },
    evicted: { label: "reported, then evicted", color: "#888888", style: "crossRot", radius: 7 },
    uncommitted: { label: "not committed (yet)", color: "#d6604d", style: "dash", radius: 8 },
  };
  const PALETTE = ["#4575b4", "#d73027", "#1a9850", "#984ea3", "#ff7f00", "#a65628",
    "#f781bf", "#666666"];
  const X_AXES = { training_iteration: "report (training_iteration)", time_total_s: "time (s)" };

  // Read by the browser tests: the current view's data and chart.
  const state = { config: null, timer: null, chart: null, view: null, trial: null,
    trials: {}, sort: {}, selected: {}, metric: null, x: "training_iteration", polls: 0 };
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

  function route(...parts) {
    return "#/" + parts.map(encodeURIComponent).join("/");
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

  // The retention manager's lookup: a literal key first, else a "/"-separated path.
  function metricOf(row, name) {
    if (row && Object.prototype.hasOwnProperty.call(row, name)) return row[name];
    let node = row;
    for (const part of name.split("/")) {
      if (node === null || typeof node !== "object" || !(part in node)) return undefined;
      node = node[part];
    }
    return node;
  }

  async function api(path, params, init) {
    const query = new URLSearchParams(params || {}).toString();
    const resp = await fetch(`api/${path}${query ? "?" + query : ""}`, init);
    let body;
    try { body = await resp.json(); } catch (e) { body = { error: resp.statusText }; }
    if (!resp.ok) throw new Error(body.error || `HTTP ${resp.status}`);
    return body;
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
    if (status === "errored" && error) attrs.title = error;
    return el("span", attrs, status);
  }

  function breadcrumb(...items) {
    const parts = [el("a", { href: "#/" }, "experiments")];
    for (const [text, href] of items) {
      parts.push(" › ", href ? el("a", { href }, text) : el("span", {}, text));
    }
    return el("nav", { class: "crumbs" }, parts);
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

  function experimentTable(exp) {
    const sort = state.sort[exp.name] || { key: "trial", dir: 1 };
    const selected = state.selected[exp.name] || (state.selected[exp.name] = new Set());
    const rows = exp.trials.slice().sort(
      (a, b) => sort.dir * compare(cellValue(a, sort.key), cellValue(b, sort.key)));
    const metric = exp.trials.map((t) => t.metric).find((m) => m) || null;
    const cols = COLUMNS.map(([k, label]) =>
      [k, k === "best_score" && metric ? `best ${metric}` : label]);
    for (const p of exp.params) cols.push([`param:${p}`, p]);

    const head = el("tr", {}, el("th", {}, ""), cols.map(([key, label]) => el("th", {
      class: "sortable" + (sort.key === key ? (sort.dir > 0 ? " asc" : " desc") : ""),
      "data-key": key,
      onclick: () => {
        state.sort[exp.name] = { key, dir: sort.key === key ? -sort.dir : 1 };
        renderOverview(state.overview);
      },
    }, label)));
    const body = rows.map((t) => {
      const box = el("input", { type: "checkbox", "aria-label": `select ${t.trial}`,
        checked: selected.has(t.trial),
        onchange: (ev) => { ev.target.checked ? selected.add(t.trial) : selected.delete(t.trial); } });
      const cells = cols.map(([key]) => {
        const v = cellValue(t, key);
        if (key === "trial") return el("td", {}, el("a", { href: route("trial", exp.name, t.trial) }, t.trial));
        if (key === "status") return el("td", {}, statusBadge(v, t.error));
        if (key === "size") return el("td", { class: "num", title: `${v} bytes` }, fmtSize(v));
        if (key === "last_report") return el("td", {}, fmtTime(v));
        if (key === "best_checkpoint") {
          return el("td", {}, v ? el("a", { href: route("checkpoint", exp.name, t.trial, v) }, v) : "-");
        }
        return el("td", { class: typeof v === "number" ? "num" : null }, fmtValue(v));
      });
      return el("tr", { "data-trial": t.trial }, el("td", {}, box), cells);
    });
    const compareButton = el("button", { type: "button", class: "compare", onclick: () => {
      const names = rows.map((t) => t.trial).filter((n) => selected.has(n));
      location.hash = route("compare", exp.name, ...(names.length ? names : rows.map((t) => t.trial)));
    } }, "Compare selected trials");
    return el("section", { class: "experiment", "data-experiment": exp.name },
      el("h2", {}, exp.name, " ", el("span", { class: "muted" }, `${rows.length} trial(s)`)),
      el("div", { class: "table-wrap" }, el("table", { class: "trials" }, el("thead", {}, head),
        el("tbody", {}, body))),
      compareButton);
  }

  function renderOverview(data) {
    state.overview = data;
    if (!data.experiments.length) {
      setMain(el("p", { class: "muted" }, "No trials under this location yet."));
      return;
    }
    setMain(data.experiments.map(experimentTable));
  }

  async function showOverview(first) {
    const data = await api("overview", first ? { full: "1" } : {});
    if (state.view === "overview") renderOverview(data);
  }

  // -- charts -------------------------------------------------------------------------

  // Shape and colour say the kind; comparing trials, the colour says the trial instead.
  function markerDataset(label, kind, points, color) {
    const k = KINDS[kind];
    return { type: "scatter", label, kind, data: points, pointStyle: k.style,
      pointRadius: k.radius, pointHoverRadius: k.radius + 3, borderColor: color || k.color,
      backgroundColor: color || k.color, borderWidth: 2, order: 0 };
  }

  // One trial as chart datasets: its curve, then one dataset per checkpoint kind.
  function trialDatasets(trial, metric, xKey, color, prefix, kinds) {
    const cps = Object.fromEntries(trial.checkpoints.map((c) => [c.name, c]));
    const line = [];
    const markers = Object.fromEntries(Object.keys(KINDS).map((k) => [k, []]));
    for (const row of trial.rows) {
      const y = metricOf(row, metric), x = row[xKey];
      if (typeof y !== "number" || typeof x !== "number") continue;
      line.push({ x, y });
      const name = row.checkpoint_dir_name;
      if (typeof name !== "string") continue;
      const c = cps[name] || { kind: "evicted", size: null };
      markers[c.kind].push({ x, y, name, size: c.size, score: c.score, kind: c.kind,
        trial: trial.trial, experiment: trial.experiment });
    }
    const sets = [{ type: "line", label: prefix + metric, data: line, borderColor: color,
      backgroundColor: color, pointRadius: 2, borderWidth: 2, tension: 0, order: 1,
      trialName: trial.trial }];
    for (const kind of kinds) {
      if (markers[kind].length || !prefix) {
        sets.push(markerDataset(prefix + KINDS[kind].label, kind, markers[kind], prefix ? color : null));
      }
    }
    return sets;
  }

  function chartOptions(metric, xKey) {
    return {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: true,
      interaction: { mode: "nearest", intersect: true },
      scales: {
        x: { type: "linear", title: { display: true, text: X_AXES[xKey] || xKey },
          ticks: xKey === "training_iteration" ? { precision: 0 } : {} },
        y: { type: "linear", title: { display: true, text: metric } },
      },
      plugins: {
        legend: { position: "bottom", labels: { usePointStyle: true,
          filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } },
        tooltip: { callbacks: { label: (ctx) => {
          const p = ctx.raw;
          if (p.name) {
            return `${p.trial} ${p.name} (${KINDS[p.kind].label}): ${metric} ${fmtValue(p.y)}, ` +
              `size ${fmtSize(p.size)}`;
          }
          return `${ctx.dataset.label}: ${fmtValue(p.y)} at ${fmtValue(p.x)}`;
        } } },
      },
      onClick: (ev, elements, chart) => {
        for (const e of elements) {
          const p = chart.data.datasets[e.datasetIndex].data[e.index];
          if (p && p.name && p.kind !== "evicted") {
            location.hash = route("checkpoint", p.experiment, p.trial, p.name);
            return;
          }
        }
      },
    };
  }

  function drawChart(canvas, datasets, metric, xKey) {
    if (state.chart) state.chart.destroy();
    state.chart = new Chart(canvas, { type: "scatter", data: { datasets },
      options: chartOptions(metric, xKey) });
  }

  function controls(metrics, onChange) {
    const metricSel = el("select", { id: "metric", onchange: (e) => { state.metric = e.target.value; onChange(); } },
      metrics.map((m) => el("option", { value: m, selected: m === state.metric }, m)));
    const xSel = el("select", { id: "xaxis", onchange: (e) => { state.x = e.target.value; onChange(); } },
      Object.entries(X_AXES).map(([k, label]) => el("option", { value: k, selected: k === state.x }, label)));
    return el("div", { class: "controls" }, el("label", {}, "metric ", metricSel),
      el("label", {}, "x axis ", xSel));
  }

  function defaultMetric(trial) {
    if (state.metric && trial.metrics.includes(state.metric)) return state.metric;
    if (trial.metric && trial.metrics.includes(trial.metric)) return trial.metric;
    const skip = new Set(["training_iteration", "timestamp", "time_total_s", "time_this_iter_s"]);
    return trial.metrics.find((m) => !skip.has(m)) || trial.metrics[0] || null;
  }

  // -- a trial ------------------------------------------------------------------------

  function checkpointTable(trial) {
    const metric = trial.metric;
    return el("table", { class: "checkpoints", id: "checkpoints" },
      el("thead", {}, el("tr", {}, ["checkpoint", "kind", metric ? metric : "score",
        "report", "size", "files", "created"].map((h) => el("th", {}, h)))),
      el("tbody", {}, trial.checkpoints.map((c) => el("tr", { "data-checkpoint": c.name, "data-kind": c.kind },
        el("td", {}, c.kind === "evicted" ? c.name
          : el("a", { href: route("checkpoint", trial.experiment, trial.trial, c.name) }, c.name)),
        el("td", {}, el("span", { class: `badge kind-${c.kind}` },
          KINDS[c.kind].label + (c.is_best ? ", best" : "") + (c.is_latest && c.kind !== "latest" ? ", latest" : ""))),
        el("td", { class: "num" }, fmtValue(c.score)),
        el("td", { class: "num" }, fmtValue(c.iteration)),
        el("td", { class: "num" }, fmtSize(c.size)),
        el("td", { class: "num" }, fmtValue(c.files)),
        el("td", {}, fmtTime(c.created_at))))));
  }

  function trialSummary(t) {
    const best = t.best_checkpoint
      ? el("span", {}, `best ${t.metric} ${fmtValue(t.best_score)} at `,
        el("a", { href: route("checkpoint", t.experiment, t.trial, t.best_checkpoint) }, t.best_checkpoint))
      : el("span", {}, "no score attribute recorded");
    const error = t.status === "errored" && t.error
      ? el("span", { class: "error-line" }, ` (last run raised ${t.error}; see error.txt) `) : "";
    return el("p", { class: "summary", id: "summary" }, statusBadge(t.status, t.error), error,
      ` ${t.total_rows} report(s), ${t.committed} committed checkpoint(s), ${fmtSize(t.size)}; `, best);
  }

  function renderTrial() {
    const t = state.trial;
    state.metric = defaultMetric(t);
    const canvas = el("canvas", { id: "chart" });
    const redraw = () => drawChart(canvas,
      trialDatasets(t, state.metric, state.x, PALETTE[0], "", Object.keys(KINDS)), state.metric, state.x);
    setMain(breadcrumb([t.experiment, null], [t.trial, null]),
      el("h1", {}, t.trial),
      el("p", { class: "muted uri" }, t.uri),
      trialSummary(t),
      controls(t.metrics, redraw),
      el("div", { class: "chart-box" }, canvas),
      el("h2", {}, "Checkpoints"), checkpointTable(t));
    if (state.metric) redraw();
  }

  async function showTrial(experiment, trial) {
    state.trial = await api("trial", { experiment, trial, since: 0 });
    renderTrial();
  }

  async function pollTrial() {
    const t = state.trial;
    const upd = await api("trial", { experiment: t.experiment, trial: t.trial, since: t.rows.length });
    if (state.view !== "trial" || state.trial !== t) return;
    const grew = upd.rows.length > 0;
    const changed = JSON.stringify(upd.checkpoints) !== JSON.stringify(t.checkpoints) ||
      upd.status !== t.status;
    upd.rows = t.rows.concat(upd.rows);
    state.trial = upd;
    if (!grew && !changed) return;
    document.getElementById("summary").replaceWith(trialSummary(upd));
    document.getElementById("checkpoints").replaceWith(checkpointTable(upd));
    if (state.chart && state.metric) {
      const sets = trialDatasets(upd, state.metric, state.x, PALETTE[0], "", Object.keys(KINDS));
      state.chart.data.datasets.forEach((d, i) => { d.data = sets[i].data; });
      state.chart.update("none");
    } else {
      renderTrial();
    }
  }

  // -- several trials -----------------------------------------------------------------

  async function showCompare(experiment, names) {
    const trials = await Promise.all(names.map((trial) => api("trial", { experiment, trial, since: 0 })));
    state.trials = trials;
    const metrics = [...new Set(trials.flatMap((t) => t.metrics))];
    state.metric = defaultMetric({ metrics, metric: trials.map((t) => t.metric).find((m) => m) });
    const canvas = el("canvas", { id: "chart" });
    const redraw = () => {
      const sets = trials.flatMap((t, i) => trialDatasets(t, state.metric, state.x,
        PALETTE[i % PALETTE.length], `${t.trial}: `, ["best", "latest", "kept"]));
      drawChart(canvas, sets, state.metric, state.x);
    };
    setMain(breadcrumb([experiment, null], ["compare", null]),
      el("h1", {}, `${experiment}: ${trials.length} trial(s)`),
      el("p", { class: "muted" }, "Curves of each trial; markers are the checkpoints each one keeps."),
      controls(metrics, redraw),
      el("div", { class: "chart-box tall" }, canvas));
    if (state.metric) redraw();
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

  async function showCheckpoint(experiment, trial, name) {
    const c = await api("checkpoint", { experiment, trial, checkpoint: name });
    const out = el("div", { id: "verify-result", class: "verify" });
    const button = el("button", { type: "button", id: "verify", onclick: () => verify(c, out, button) },
      "Verify");
    const state_ = c.state === "committed" ? null
      : el("p", { class: "error" }, `${c.state}${c.file ? ` (${c.file})` : ""}: ${c.reason || "not committed"}`);
    setMain(breadcrumb([experiment, null], [trial, route("trial", experiment, trial)], [name, null]),
      el("h1", {}, name),
      el("p", { class: "muted uri" }, c.uri),
      state_,
      el("div", { class: "verify-row" }, button, out),
      el("h2", {}, `Manifest: ${c.manifest.length} file(s), ${fmtSize(c.size)}`),
      el("table", { id: "manifest", class: "manifest" },
        el("thead", {}, el("tr", {}, el("th", {}, "file"), el("th", {}, "size"), el("th", {}, "CRC32C"))),
        el("tbody", {}, c.manifest.map((f) => el("tr", {}, el("td", {}, f.path),
          el("td", { class: "num" }, fmtSize(f.size)), el("td", { class: "mono" }, f.crc32c || "-"))))),
      el("h2", {}, "Download or resume"),
      snippet("snippet-shell", c.snippets.shell),
      snippet("snippet-python", c.snippets.python),
      el("div", { class: "columns" },
        el("div", {}, el("h2", {}, "User metadata"), jsonBlock("user-metadata", c.user_metadata)),
        el("div", {}, el("h2", {}, "Internal metadata"), jsonBlock("internal-metadata", c.internal_metadata))));
  }

  // -- routing and live refresh ---------------------------------------------------------

  async function onRoute() {
    if (state.chart) { state.chart.destroy(); state.chart = null; }
    const parts = location.hash.replace(/^#\/?/, "").split("/").filter((p) => p !== "")
      .map(decodeURIComponent);
    const [view, ...args] = parts;
    state.view = view || "overview";
    try {
      if (!view) await showOverview(true);
      else if (view === "trial" && args.length === 2) await showTrial(args[0], args[1]);
      else if (view === "compare" && args.length >= 2) await showCompare(args[0], args.slice(1));
      else if (view === "checkpoint" && args.length === 3) await showCheckpoint(...args);
      else throw new Error("unknown page: " + location.hash);
    } catch (err) {
      showError(err);
    }
  }

  async function poll() {
    const live = document.getElementById("live");
    if (state.busy) return;  // a slow storage: never stack polls
    state.busy = true;
    try {
      if (state.view === "overview") await showOverview(false);
      else if (state.view === "trial" && state.trial) await pollTrial();
      state.polls += 1;
      live.textContent = `live · ${new Date().toLocaleTimeString()}`;
      live.classList.remove("stale");
    } catch (err) {
      live.textContent = `not refreshed: ${err.message}`;
      live.classList.add("stale");
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
    document.getElementById("location").textContent = state.config.uri;
    window.addEventListener("hashchange", onRoute);
    await onRoute();
    state.timer = setInterval(poll, state.config.refresh_ms);
  }

  start();
})();
