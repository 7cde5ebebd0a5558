// moestream engine view: one reader of /v1/engine/events while the Engine tab is shown.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const COLORS = { ".": "#e6e6ea", c: "#5b8def", p: "#7a3fc0", f: "#f0a020", h: "#2bb673" };
  const NAMES = { p: "pinned", c: "cached", f: "in flight", h: "recently hit", ".": "not cached" };
  const KEEP_S = 300; // the series keep the last five minutes
  const series = { hit: [], disk: [], decode: [], prefill: [], batch: [] };
  let config = null;
  let reading = null; // AbortController of the open stream
  const seen = { states: 0, gridChanges: 0, lastGrid: "" }; // read by the browser tests

  function legend() {
    $("legend").replaceChildren(...Object.entries(NAMES).map(([k, name]) => {
      const s = document.createElement("span");
      s.innerHTML = `<i style="background:${COLORS[k]}"></i>`;
      s.append(name);
      return s;
    }));
  }

  function budget(b) {
    const bar = $("budget-bar");
    if (!b) { bar.replaceChildren(); $("budget-text").textContent = "no budget plan (slots given directly)"; return; }
    const parts = [["resident", "#6b7a8f"], ["compute", "#c77d2e"], ["reader", "#3f9aa8"], ["reserve", "#999"], ["experts", "#5b8def"]];
    bar.replaceChildren(...parts.map(([k, color]) => {
      const s = document.createElement("span");
      const mib = b[k + "_mib"];
      s.style.flex = String(Math.max(mib, 0.0001));
      s.style.background = color;
      s.textContent = `${k} ${Math.round(mib)}`;
      s.title = `${k}: ${mib} MiB`;
      return s;
    }));
    $("budget-text").textContent = b.text;
  }

  function push(name, t, v) {
    const s = series[name];
    s.push([t, v]);
    while (s.length && s[0][0] < t - KEEP_S) s.shift();
  }

  function chart(id, lines, fixedMax) {
    const cv = $(id), ctx = cv.getContext("2d");
    if (cv.clientWidth && cv.width !== cv.clientWidth) cv.width = cv.clientWidth; // sharp at any width
    const w = cv.width, h = cv.height;
    ctx.clearRect(0, 0, w, h);
    const pts = lines.flatMap(([s]) => s);
    if (!pts.length) return;
    const t1 = pts.reduce((a, p) => Math.max(a, p[0]), 0), t0 = t1 - KEEP_S;
    const max = fixedMax || Math.max(1e-9, ...pts.map((p) => p[1] || 0)) * 1.1;
    ctx.fillStyle = "#6b6b70";
    ctx.font = "10px sans-serif";
    ctx.fillText(max >= 10 ? max.toFixed(0) : max.toFixed(2), 2, 10);
    ctx.fillText("5 min", w - 28, h - 2);
    for (const [s, color] of lines) {
      ctx.strokeStyle = color;
      ctx.beginPath();
      let started = false;
      for (const [t, v] of s) {
        if (v == null) { started = false; continue; }
        const x = ((t - t0) / KEEP_S) * w, y = h - 12 - (v / max) * (h - 24);
        if (started) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        started = true;
      }
      ctx.stroke();
    }
  }

  function grid(rows) {
    const cv = $("grid"), ctx = cv.getContext("2d");
    const n = rows.length, m = rows[0] ? rows[0].length : 0;
    if (!n || !m) return;
    const cell = Math.max(2, Math.min(14, Math.floor(cv.clientWidth / m) || 8));
    cv.width = cell * m; cv.height = cell * n;
    cv.style.height = cv.height + "px";
    cv.style.width = cv.width + "px";
    for (let l = 0; l < n; l++) {
      for (let e = 0; e < m; e++) {
        ctx.fillStyle = COLORS[rows[l][e]] || "#000";
        ctx.fillRect(e * cell, l * cell, cell - (cell > 3), cell - (cell > 3));
      }
    }
    const joined = rows.join("");
    if (joined !== seen.lastGrid) { seen.gridChanges++; seen.lastGrid = joined; }
  }

  function now(s) {
    const fmt = (v, d = 1) => (v == null ? "–" : Number(v).toFixed(d));
    const items = [
      ["hit rate", s.hit_rate == null ? "–" : (100 * s.hit_rate).toFixed(1) + " %"],
      ["since start", (100 * s.hit_rate_total).toFixed(1) + " %"],
      ["disk", fmt(s.disk_mb_s) + " MB/s"], ["decode", fmt(s.decode_tps) + " tok/s"],
      ["prefill", fmt(s.prefill_tps) + " tok/s"], ["batch rows", String(s.batch)],
      ["running", String(s.running)], ["queued", String(s.queued)],
      ["slots used", `${s.slots_used} / ${config ? config.n_slots : "?"}`], ["pinned", String(s.pinned)],
      ["RSS", fmt(s.rss_mib, 0) + " MiB"], ["hits / misses", `${s.hits} / ${s.misses}`],
    ];
    $("now").replaceChildren(...items.flatMap(([k, v]) => {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = k; dd.textContent = v;
      dd.dataset.name = k;
      return [dt, dd];
    }));
  }

  function requests(list) {
    $("requests").tBodies[0].replaceChildren(...list.map((r) => {
      const tr = document.createElement("tr");
      for (const v of [r.id, r.phase, r.prompt_tokens, r.cached_tokens, r.generated]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      return tr;
    }));
  }

  function onState(s) {
    seen.states++;
    const t = s.t;
    push("hit", t, s.hit_rate); push("disk", t, s.disk_mb_s); push("decode", t, s.decode_tps);
    push("prefill", t, s.prefill_tps); push("batch", t, s.batch);
    now(s);
    grid(s.grid);
    requests(s.requests);
    chart("chart-hit", [[series.hit, "#2bb673"]], 1);
    chart("chart-disk", [[series.disk, "#f0a020"]]);
    chart("chart-tps", [[series.decode, "#2f5fd0"], [series.prefill, "#c77d2e"]]);
    chart("chart-batch", [[series.batch, "#7a3fc0"]], config ? config.max_batch : 1);
  }

  async function open() {
    if (reading) return;
    reading = new AbortController();
    const signal = reading.signal;
    while (!signal.aborted) {
      try {
        const res = await window.moestream.api("/v1/engine/events", { signal });
        if (!res.ok) throw new Error(`HTTP ${res.status}`);
        $("engine-status").textContent = "live";
        await window.moestream.readSSE(res, (name, data) => {
          const body = JSON.parse(data);
          if (name === "config") {
            config = body;
            budget(body.budget);
            $("engine-status").textContent = `live: ${body.layers} layers x ${body.experts} experts, ${body.n_slots} slots of ${body.slot_mib} MiB`;
          } else if (name === "state") onState(body);
        }, signal);
      } catch (e) {
        if (signal.aborted) break;
        $("engine-status").textContent = "disconnected (" + (e.message || e) + "); retrying";
      }
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  function close() {
    if (reading) reading.abort();
    reading = null;
  }

  window.moestreamEngine = seen;
  document.addEventListener("DOMContentLoaded", legend);
  // read the events only while the view is shown: a closed view costs the server nothing
  document.addEventListener("moestream-tab", (e) => (e.detail === "engine" ? open() : close()));
})();
