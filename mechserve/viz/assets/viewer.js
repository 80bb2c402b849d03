// mechserve trace viewer: plain JS, no network. The data is the trace document of mechserve/viz/trace.py
// plus "timeline" (cells, tokens, marks), "palette" and "unavailable", embedded in #trace-data.
(function () {
  "use strict";

  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const steps = data.steps;
  const ids = data.requests;
  const snaps = data.snapshots; // null for a --json trace
  const pal = data.palette;
  const N = steps.length;
  const FREE = -1;
  const CACHE = -2;
  const $ = (id) => document.getElementById(id);
  let cur = 0;
  let timer = null;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-") || k === "title") node.setAttribute(k, v);
      else node.style[k] = v;
    }
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  }

  function unavailable(node, why) {
    clear(node).appendChild(el("p", { class: "unavailable" }, "Not in this trace: " + why + "."));
  }

  const reqColor = (code) => pal.requests[code % pal.requests.length];
  const index = new Map(ids.map((rid, i) => [rid, i]));
  const colorOf = (rid) => reqColor(index.has(rid) ? index.get(rid) : 0);

  // Token ids per request, cumulative: upto[rid][s] = how many ids the request had after step s.
  const tokenIds = new Map();
  const upto = new Map();
  steps.forEach((rec, s) => {
    for (const [rid, got] of Object.entries(rec.tokens || {})) {
      if (!tokenIds.has(rid)) {
        tokenIds.set(rid, []);
        upto.set(rid, new Array(N).fill(0));
      }
      tokenIds.get(rid).push(...got);
    }
    for (const [rid, counts] of upto) counts[s] = tokenIds.get(rid).length;
  });

  // ---- the step's fields ------------------------------------------------------------------------------------
  function formatValue(name, value) {
    if (name === "rejected") return value.map(([rid, why]) => rid + "=" + why).join(", ");
    if (Array.isArray(value)) return value.join(", ");
    if (value && typeof value === "object") {
      return Object.entries(value)
        .map(([k, v]) => k + "=" + (Array.isArray(v) ? "[" + v.join(", ") + "]" : v))
        .join(", ");
    }
    return String(value);
  }

  function isEmpty(value) {
    if (Array.isArray(value)) return value.length === 0;
    if (value && typeof value === "object") return Object.keys(value).length === 0;
    return value === null || value === undefined;
  }

  function renderFields(rec) {
    const dl = clear($("fields"));
    let shown = 0;
    for (const [name, value] of Object.entries(rec)) {
      if (name === "step" || name === "explain" || isEmpty(value)) continue;
      dl.appendChild(el("dt", { "data-field": name }, name));
      dl.appendChild(el("dd", { "data-field": name }, formatValue(name, value)));
      shown++;
    }
    if (!shown) dl.appendChild(el("dd", { class: "empty" }, "nothing happened in this step"));
    const ul = clear($("explain"));
    if (!("explain" in rec)) {
      ul.appendChild(el("li", { class: "empty" }, "no sentences: run with --explain (or write the trace with --viz) to see them"));
    }
    for (const sentence of rec.explain || []) ul.appendChild(el("li", {}, sentence));
  }

  // ---- timeline (canvas) -----------------------------------------------------------------------------------
  const tl = data.timeline;
  const rows = ids.length;
  const cellH = Math.max(3, Math.min(22, Math.floor(480 / Math.max(rows, 1))));
  const labelW = cellH >= 9 ? 70 : 8;
  let cellW = 10;

  function drawTimeline() {
    const canvas = $("timeline");
    const wrap = $("timeline-wrap");
    const avail = Math.max(200, wrap.clientWidth - 4);
    cellW = Math.max(3, Math.min(56, Math.floor((avail - labelW) / Math.max(N, 1))));
    const w = labelW + cellW * N;
    const h = cellH * rows + 2;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = w * ratio;
    canvas.height = h * ratio;
    canvas.style.width = w + "px";
    canvas.style.height = h + "px";
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, w, h);
    const gap = cellW >= 8 && cellH >= 8 ? 1 : 0;
    for (let r = 0; r < rows; r++) {
      if (labelW > 8) {
        g.fillStyle = "#1f2328";
        g.font = Math.min(12, cellH - 2) + "px system-ui, sans-serif";
        g.textBaseline = "middle";
        g.fillText(ids[r].length > 9 ? ids[r].slice(0, 8) + "…" : ids[r], 2, r * cellH + cellH / 2);
      }
      for (let c = 0; c < N; c++) {
        const code = tl.cells[r][c];
        if (!code) continue;
        g.fillStyle = pal.cells[code][1];
        g.fillRect(labelW + c * cellW, r * cellH, cellW - gap, cellH - gap);
        if (cellW >= 20 && cellH >= 14 && tl.tokens[r][c]) {
          g.fillStyle = "#ffffff";
          g.font = "bold 11px system-ui, sans-serif";
          g.textAlign = "center";
          g.fillText(String(tl.tokens[r][c]), labelW + c * cellW + cellW / 2, r * cellH + cellH / 2);
          g.textAlign = "left";
        }
      }
    }
    const shape = {
      admitted: (x, y) => { g.beginPath(); g.moveTo(x + 1, y + 2); g.lineTo(x + 1 + cellH / 2.5, y + cellH / 2); g.lineTo(x + 1, y + cellH - 2); g.fill(); },
      finished: (x, y) => g.fillRect(x + cellW - gap - 3, y + 1, 3, cellH - 2),
      reused: (x, y) => { g.beginPath(); g.arc(x + cellW - 5, y + 4, Math.max(1.5, cellH / 6), 0, 7); g.fill(); },
      rejected: (x, y) => { g.font = "bold " + cellH + "px sans-serif"; g.fillText("×", x + 1, y + cellH / 2); },
      aborted: (x, y) => { g.font = "bold " + cellH + "px sans-serif"; g.fillText("×", x + 1, y + cellH / 2); },
    };
    for (const [name, color] of pal.marks) {
      g.fillStyle = color;
      for (const [r, c] of tl.marks[name] || []) shape[name](labelW + c * cellW, r * cellH);
    }
    g.strokeStyle = "#0969da";
    g.lineWidth = 2;
    g.strokeRect(labelW + cur * cellW - 1, 1, cellW + 1, h - 2);
  }

  function timelineLegend() {
    const box = $("timeline-legend");
    const used = new Set(tl.cells.flat());
    pal.cells.forEach(([name, color, label], code) => {
      if (!code || !used.has(code)) return;
      const item = el("span", {}, "");
      item.appendChild(el("span", { class: "swatch", background: color }));
      item.appendChild(document.createTextNode(label));
      box.appendChild(item);
    });
    const symbols = { admitted: "▶", reused: "●", finished: "▮", rejected: "×", aborted: "×" };
    for (const [name, color, label] of pal.marks) {
      if (!(tl.marks[name] || []).length) continue;
      const item = el("span", {}, "");
      item.appendChild(el("b", { color: color, marginRight: "4px" }, symbols[name]));
      item.appendChild(document.createTextNode(label));
      box.appendChild(item);
    }
  }

  // ---- page pool -------------------------------------------------------------------------------------------
  function ownerLabel(code) {
    return code === FREE ? "free" : code === CACHE ? "cache" : ids[code];
  }

  function renderPool(s) {
    const pool = $("pool");
    if (data.unavailable.pages) {
      unavailable(pool, data.unavailable.pages);
      $("pool-counts").textContent = "";
      return;
    }
    clear(pool);
    const owners = snaps[s].owners;
    const before = s > 0 ? snaps[s - 1].owners : null;
    const evicted = new Set(steps[s].evicted || []);
    pool.classList.toggle("compact", owners.length > 256);
    let free = 0, cached = 0;
    owners.forEach((code, page) => {
      const kind = code === FREE ? "free" : code === CACHE ? "cache" : "request";
      if (kind === "free") free++;
      if (kind === "cache") cached++;
      const attrs = {
        class: "page " + kind,
        "data-page": String(page),
        "data-kind": kind,
        "data-owner": kind === "request" ? ids[code] : kind,
        title: "page " + page + ": " + ownerLabel(code),
        background: kind === "free" ? pal.free : kind === "cache" ? pal.cache : reqColor(code),
      };
      const cell = el("div", attrs);
      if (before && before[page] !== code) cell.classList.add("changed");
      if (evicted.has(page)) cell.classList.add("evicted");
      cell.appendChild(el("span", { class: "pid" }, String(page)));
      cell.appendChild(el("span", { class: "who" }, kind === "free" ? "·" : kind === "cache" ? "cache" : ids[code]));
      pool.appendChild(cell);
    });
    const owned = owners.length - free - cached;
    $("pool-counts").textContent =
      owners.length + " pages: " + free + " free · " + owned + " owned by requests · " + cached +
      " cached" + (evicted.size ? " · evicted this step: " + [...evicted].join(", ") : "") +
      ". Blue outline: owner changed in this step.";
  }

  // ---- radix tree ------------------------------------------------------------------------------------------
  function blockLabel(b) {
    const [tokens, text] = data.blocks[b];
    if (text !== null && text !== undefined) return JSON.stringify(text);
    return "[" + tokens.join(" ") + "]";
  }

  function renderTree(s) {
    const box = $("tree");
    if (data.unavailable.tree) return unavailable(box, data.unavailable.tree);
    clear(box);
    const nodes = snaps[s].tree;
    const before = new Set(s > 0 && snaps[s - 1].tree ? snaps[s - 1].tree.map((n) => n[0] + ":" + n[2]) : []);
    const users = new Map();
    for (const [rid, view] of Object.entries(snaps[s].requests)) {
      for (const page of view[3]) {
        if (!users.has(page)) users.set(page, []);
        users.get(page).push(rid);
      }
    }
    const root = el("ul", {});
    const rootItem = el("li", { class: "tree-root" });
    rootItem.appendChild(el("span", { class: "node-root" }, "root · " + nodes.length + " cached block(s)"));
    root.appendChild(rootItem);
    box.appendChild(root);
    const lists = [];
    const top = el("ul", {});
    rootItem.appendChild(top);
    nodes.forEach(([page, parent, block], i) => {
      const li = el("li", { "data-page": String(page), class: "tree-node" });
      if (s > 0 && !before.has(page + ":" + block)) li.classList.add("new-node");
      li.appendChild(el("span", { class: "node", background: pal.cache, "data-page": String(page) }, "page " + page));
      li.appendChild(el("span", { class: "block" }, blockLabel(block)));
      if (users.has(page)) li.appendChild(el("span", { class: "refs" }, "in the page table of " + users.get(page).join(", ")));
      lists[i] = el("ul", {});
      li.appendChild(lists[i]);
      (parent < 0 ? top : lists[parent]).appendChild(li);
    });
    if (!nodes.length) top.appendChild(el("li", { class: "empty" }, "(empty: nothing published yet)"));
  }

  // ---- page tables -----------------------------------------------------------------------------------------
  function renderTables(s) {
    const box = $("tables");
    if (data.unavailable.pages) return unavailable(box, data.unavailable.pages);
    clear(box);
    const owners = snaps[s].owners;
    const live = Object.entries(snaps[s].requests);
    if (!live.length) box.appendChild(el("p", { class: "empty" }, "no request is waiting or running after this step"));
    for (const [rid, [state, computed, generated, table]] of live) {
      const row = el("div", { class: "ptable", "data-request": rid });
      row.appendChild(el("span", { class: "rid", color: colorOf(rid) }, rid));
      row.appendChild(el("span", { class: "state" }, state + " · computed " + computed + " · generated " + generated));
      const chips = el("span", { class: "chips" });
      row.appendChild(chips);
      if (!table.length) chips.appendChild(el("span", { class: "empty" }, "no pages"));
      for (const page of table) {
        const cached = owners[page] === CACHE;
        chips.appendChild(el("span", {
          class: "chip" + (cached ? " cache" : ""),
          "data-page": String(page),
          title: "page " + page + (cached ? " (cache, shared)" : " (" + rid + "'s own)"),
          background: cached ? pal.cache : colorOf(rid),
        }, String(page)));
      }
      box.appendChild(row);
    }
  }

  // ---- text ------------------------------------------------------------------------------------------------
  // A --json trace's final texts, by engine id: "r0" for one sample, "r0#1" for sample 1 of several.
  const finalText = new Map();
  for (const o of data.outputs || []) {
    finalText.set(String(o.request_id) + "#" + (o.index || 0), o.text);
    if (!finalText.has(String(o.request_id))) finalText.set(String(o.request_id), o.text);
  }

  function renderText(s) {
    const box = clear($("text"));
    const text = snaps && snaps[s].text;
    let shown = 0;
    for (const rid of ids) {
      const n = upto.has(rid) ? upto.get(rid)[s] : 0;
      if (!n && !(text && rid in text)) continue;
      const out = el("div", { class: "out", "data-request": rid });
      out.appendChild(el("span", { class: "rid", color: colorOf(rid) }, rid));
      if (text) {
        if (data.prompts[rid] !== undefined) out.appendChild(el("span", { class: "prompt" }, data.prompts[rid]));
        out.appendChild(el("span", { class: "generated" }, text[rid] || ""));
      } else {
        out.appendChild(el("span", { class: "ids" }, n + " token id(s): " + tokenIds.get(rid).slice(0, n).join(" ")));
        if (s === N - 1 && finalText.has(rid)) out.appendChild(el("span", { class: "final" }, "final text: " + JSON.stringify(finalText.get(rid))));
      }
      box.appendChild(out);
      shown++;
    }
    if (!shown) box.appendChild(el("p", { class: "empty" }, "no token sampled yet"));
    if (data.unavailable.text) box.appendChild(el("p", { class: "unavailable" }, "Token ids only: " + data.unavailable.text + "."));
  }

  // ---- stepping --------------------------------------------------------------------------------------------
  function show(s) {
    cur = Math.max(0, Math.min(N - 1, s));
    $("slider").value = String(cur);
    $("step-label").textContent = "step " + steps[cur].step + " (" + (cur + 1) + " of " + N + ")";
    document.body.setAttribute("data-step", String(steps[cur].step));
    renderFields(steps[cur]);
    renderPool(cur);
    renderTree(cur);
    renderTables(cur);
    renderText(cur);
    drawTimeline();
    if (history.replaceState) history.replaceState(null, "", "#step=" + steps[cur].step);
  }

  function play() {
    if (timer) {
      clearInterval(timer);
      timer = null;
      $("play").textContent = "▶ play";
      return;
    }
    if (cur === N - 1) show(0);
    $("play").textContent = "❚❚ pause";
    timer = setInterval(() => (cur >= N - 1 ? play() : show(cur + 1)), 700);
  }

  function start() {
    $("title").textContent = data.title || "mechserve trace";
    const engine = Object.entries(data.engine).map(([k, v]) => k + " " + v).join(" · ");
    const source = { spec: "scripted executor", model: "real model", json: "read from a --json trace" }[data.source];
    $("meta").textContent = [ids.length + " request(s)", N + " step(s)", engine, source].filter(Boolean).join(" · ");
    const slider = $("slider");
    slider.max = String(N - 1);
    slider.addEventListener("input", () => show(Number(slider.value)));
    $("first").addEventListener("click", () => show(0));
    $("prev").addEventListener("click", () => show(cur - 1));
    $("next").addEventListener("click", () => show(cur + 1));
    $("last").addEventListener("click", () => show(N - 1));
    $("play").addEventListener("click", play);
    $("timeline").addEventListener("click", (e) => {
      const x = e.offsetX - labelW;
      if (x >= 0) show(Math.floor(x / cellW));
    });
    document.addEventListener("keydown", (e) => {
      if (e.altKey || e.ctrlKey || e.metaKey) return;
      const moves = { ArrowRight: 1, ArrowDown: 1, l: 1, j: 1, ArrowLeft: -1, ArrowUp: -1, h: -1, k: -1 };
      if (e.key in moves) show(cur + moves[e.key]);
      else if (e.key === "Home") show(0);
      else if (e.key === "End") show(N - 1);
      else if (e.key === " ") play();
      else return;
      e.preventDefault();
    });
    window.addEventListener("resize", drawTimeline);
    timelineLegend();
    const m = /step=(\d+)/.exec(location.hash);
    const wanted = m ? steps.findIndex((r) => r.step === Number(m[1])) : 0;
    show(wanted < 0 ? 0 : wanted);
    document.body.setAttribute("data-ready", "1");
  }

  if (N) start();
  else $("title").textContent = "This trace has no step.";
})();
