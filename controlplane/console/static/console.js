// CacheTTL console: draws a page's charts from its data (uPlot) and refreshes them by
// polling the page's JSON twin. No inline code: the page data is a JSON block.
"use strict";
(function () {
  const block = document.getElementById("page-data");
  if (!block) return;
  const api = block.dataset.api;
  const pollMs = 1000 * Number(block.dataset.poll || 5);
  const FLOOR = 1e-3; // seconds: where zero durations sit on log axes
  const COLORS = ["#1b6ca8", "#d1495b", "#edae49", "#66a182", "#8d6a9f", "#00798c", "#555"];
  const charts = {};

  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o == null ? o : o[k]), obj);
  }
  function secs(x) {
    if (x == null) return "–";
    return x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s";
  }
  function size(el) {
    return { width: Math.max(280, el.clientWidth || 480), height: 240 };
  }
  function plot(id, opts, data) {
    const el = document.getElementById(id);
    if (!el) return;
    if (charts[id]) charts[id].destroy();
    el.dataset.points = String(data[0].length);
    charts[id] = new uPlot(Object.assign(size(el), opts), data, el);
  }
  function ttlLine(ttl, f) {
    return {
      hooks: {
        draw: [(u) => {
          if (ttl == null || ttl <= 0) { u.root.parentElement.dataset.ttl = "none"; return; }
          const x = u.valToPos(Math.max(ttl, FLOOR), "x", true);
          const inside = x >= u.bbox.left - 1 && x <= u.bbox.left + u.bbox.width + 1;
          u.root.parentElement.dataset.ttlInside = inside ? "yes" : "no";
          const ctx = u.ctx;
          ctx.save();
          ctx.strokeStyle = "#d1495b";
          ctx.lineWidth = 2 * devicePixelRatio;
          ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
          ctx.fillStyle = "#d1495b";
          ctx.font = 12 * devicePixelRatio + "px sans-serif";
          ctx.textAlign = "left";  // uPlot leaves its axes' alignment set
          const label = " TTL " + secs(ttl) + ", F = " + (f || 0).toFixed(2) + " ";
          const width = ctx.measureText(label).width;  // left of the line near the right edge
          const at = x + width > u.bbox.left + u.bbox.width ? x - width : x;
          ctx.fillText(label, at, u.bbox.top + 14 * devicePixelRatio);
          ctx.restore();
          u.root.parentElement.dataset.ttl = String(ttl);
        }],
      },
    };
  }
  const logX = { x: { time: false, distr: 3, log: 10 } };
  // A log x scale whose range always holds the TTL, so that its line is on the chart
  // even when every sample is far shorter or longer than it (whole decades either side).
  function logXWith(ttl) {
    const t = ttl != null && ttl > 0 ? Math.max(ttl, FLOOR) : null;
    return { x: { time: false, distr: 3, log: 10, range: (u, min, max) => {
      const lo = t == null ? min : Math.min(min == null ? t : min, t);
      const hi = t == null ? max : Math.max(max == null ? t : max, t);
      return uPlot.rangeLog(lo, hi, 10, true);
    } } };
  }
  // Log axes: a label at each power of ten only (the other ticks stay unlabelled).
  const decade = (v) => v != null && Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-6;
  const logAxis = { values: (u, ticks) => ticks.map((v) => (decade(v) ? secs(v) : "")) };

  function distribution(d, decision) {
    if (!d) return;
    const cdf = d.cdf || [];
    const xs = cdf.map((p) => Math.max(p[0], FLOOR));
    const plugins = decision ? [ttlLine(decision.ttl_s, decision.f_ttl)] : [];
    const x = decision ? logXWith(decision.ttl_s) : logX;
    plot("cdf", {
      scales: Object.assign({ y: { range: [0, 1] } }, x),
      axes: [logAxis, {}],
      series: [{}, { label: "F(t)", stroke: COLORS[0], width: 2 }],
      legend: { show: false },
      plugins: plugins,
    }, [xs, cdf.map((p) => p[1])]);
    const h = d.histogram || [];
    if (h.length) {
      const hx = h.map((b) => b[0]).concat([h[h.length - 1][1]]);
      const hy = h.map((b) => b[2]).concat([0]);
      plot("hist", {
        scales: x,
        axes: [logAxis, {}],
        series: [{}, { label: "calls", stroke: COLORS[3], fill: "rgba(102,161,130,0.35)",
          paths: uPlot.paths.stepped({ align: 1 }) }],
        legend: { show: false },
        plugins: plugins,
      }, [hx, hy]);
    }
  }
  function overTime(id, t, named) {
    const keys = Object.keys(named);
    if (!t || !t.length) return;
    plot(id, {
      series: [{}].concat(keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 2 }))),
    }, [t].concat(keys.map((k) => named[k])));
  }
  function workload(series) {
    if (!series || !series.length) return;
    plot("workload", {
      scales: { eta: { range: [0, 1] } },
      axes: [{}, { scale: "eta", label: "η" }, { scale: "s", side: 1, label: "T", values: (u, v) => v.map(secs) }],
      series: [{}, { label: "η", scale: "eta", stroke: COLORS[0], width: 2 },
        { label: "T", scale: "s", stroke: COLORS[1], width: 2 }],
    }, [series.map((p) => p.t), series.map((p) => p.eta), series.map((p) => p.queue_delay_s)]);
  }
  function draw(data) {
    distribution(data.distribution, data.decision);
    if (data.timeline) {
      overTime("outcomes", data.timeline.t, data.timeline.outcomes);
      overTime("reasons", data.timeline.t, data.timeline.reasons);
    }
    workload(data.series);
    const cold = document.getElementById("cold-start");
    if (cold && data.decision) cold.hidden = !data.decision.cold_start;
    document.querySelectorAll("[data-k]").forEach((el) => {
      const v = get(data, el.dataset.k);
      if (v === undefined) return;
      const fmt = el.dataset.fmt;
      el.textContent = v == null ? "–" : fmt === "s" ? secs(v) : fmt === "p" ? Number(v).toFixed(3) : String(v);
    });
    document.body.dataset.drawn = String(Date.now());
  }
  async function poll() {
    try {
      const r = await fetch(api, { credentials: "same-origin", headers: { accept: "application/json" } });
      if (r.status === 401) { window.location.assign("/login"); return; }
      if (r.ok) draw(await r.json());
    } catch (e) { /* the server restarts: try again next time */ }
    setTimeout(poll, pollMs);
  }
  draw(JSON.parse(block.textContent));
  setTimeout(poll, pollMs);
})();
