/* mhsa attention explorer: the page's behaviour, in plain JS (no library, no network).
 *
 * Reads the JSON in #data (labels, names, per-head summaries, section offsets) and
 * inflates its blob (zlib, by the browser's DecompressionStream): float32 scales, then
 * uint8 thumbnails, maps and rollout, each row stored as round(255 p / max(row)).
 * Draws the layer x head grid of thumbnails, the summary table, and the chosen map
 * with its token columns. Hovering a token sets data-weight (the probability) on the
 * tokens of the other column and draws lines weighted by it.
 */
(function () {
  "use strict";

  const D = JSON.parse(document.getElementById("data").textContent);
  const $ = (id) => document.getElementById(id);
  const Q = D.queries.length;
  const K = D.keys.length;
  const R = D.rows.length;
  const LAYERS = D.layers.length;
  const H = D.heads;
  const rowOf = new Int32Array(Q).fill(-1); // query index -> stored row, or -1
  D.rows.forEach((query, row) => { rowOf[query] = row; });
  const slotOf = new Map(D.stored.map(([layer, head], slot) => [layer + ":" + head, slot]));
  const state = { kind: null, layer: null, head: null, values: null, scales: null, rest: null,
                  token: null, scale: "row", geom: null };
  let A = null; // the typed arrays of the blob's sections
  let queryEls = [];
  let keyEls = [];
  let restEl = null; // the keys left out of the maps, as one (D.rest)

  // a viridis-like ramp: 256 RGB entries between five stops
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const RAMP = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = (i / 255) * (STOPS.length - 1);
    const k = Math.min(Math.floor(t), STOPS.length - 2);
    const f = t - k;
    for (let c = 0; c < 3; c++) RAMP[i * 3 + c] = Math.round(STOPS[k][c] * (1 - f) + STOPS[k + 1][c] * f);
  }
  const ACCENT = "217, 72, 15";

  async function inflate(base64) {
    const text = atob(base64);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }

  function section(buffer, name, Type) {
    const where = D.sections[name];
    return where ? new Type(buffer, where[0], where[1]) : null;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* a (height x width) canvas of uint8 values through the ramp */
  function paint(canvas, values, height, width) {
    canvas.width = width;
    canvas.height = height;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(width, height);
    for (let i = 0; i < width * height; i++) {
      const v = values[i];
      image.data[i * 4] = RAMP[v * 3];
      image.data[i * 4 + 1] = RAMP[v * 3 + 1];
      image.data[i * 4 + 2] = RAMP[v * 3 + 2];
      image.data[i * 4 + 3] = 255;
    }
    ctx.putImageData(image, 0, 0);
    return canvas;
  }

  /* ---- per-head summaries ---- */

  const METRICS = [
    ["entropy", "entropy (bits)"],
    ["distance", "mean distance (tokens)"],
    ["first", "probability on the first key"],
    ["offset_share", "share of rows at the top offset"],
    ["shown", "probability on the shown keys"],
  ].filter(([name]) => D.stats[name] && D.stats[name][0][0] !== null);

  function tags(layer, head) {
    const s = D.stats;
    const out = [];
    if (s.first[layer][head] >= 0.5) out.push("sink");
    const share = s.offset_share[layer][head];
    if (share !== null && share >= 0.6) {
      const offset = s.offset[layer][head];
      out.push(offset === 0 ? "self" : offset === 1 ? "prev" : offset > 0 ? "\u2212" + offset : "+" + -offset);
    }
    const distance = s.distance[layer][head];
    if (distance !== null && distance <= 2 && out.length === 0) out.push("local");
    return out;
  }

  function describe(layer, head) {
    const s = D.stats;
    const parts = ["entropy " + s.entropy[layer][head].toFixed(2) + " bits"];
    if (s.distance[layer][head] !== null) parts.push("mean distance " + s.distance[layer][head].toFixed(2));
    parts.push("first key " + s.first[layer][head].toFixed(3));
    if (s.offset[layer][head] !== null) {
      parts.push("top offset " + s.offset[layer][head] + " (" + Math.round(100 * s.offset_share[layer][head]) + "% of rows)");
    }
    if (s.shown[layer][head] !== null) parts.push("on shown keys " + s.shown[layer][head].toFixed(3));
    const found = tags(layer, head);
    return parts.join(" \u00b7 ") + (found.length ? " \u00b7 " + found.join(", ") : "");
  }

  function drawSummary() {
    const select = $("metric");
    for (const [name, label] of METRICS) select.append(new Option(label, name));
    select.addEventListener("change", () => fillSummary(select.value));
    fillSummary(METRICS[0][0]);
  }

  function fillSummary(metric) {
    const table = $("summary");
    table.textContent = "";
    const values = D.stats[metric];
    const flat = values.flat();
    const low = Math.min(...flat);
    const span = Math.max(...flat) - low || 1;
    const head = el("tr");
    head.append(el("th"));
    for (let h = 0; h < H; h++) head.append(el("th", "", "h" + h));
    table.append(head);
    for (let l = 0; l < LAYERS; l++) {
      const row = el("tr");
      row.append(el("th", "", D.layers[l]));
      for (let h = 0; h < H; h++) {
        const v = values[l][h];
        const cell = el("td", "", v.toFixed(2));
        const i = Math.round(((v - low) / span) * 255);
        cell.style.background = "rgb(" + RAMP[i * 3] + "," + RAMP[i * 3 + 1] + "," + RAMP[i * 3 + 2] + ")";
        cell.style.color = i > 150 ? "#000" : "#fff";
        cell.title = D.layers[l] + " head " + h + ": " + describe(l, h);
        cell.dataset.layer = l;
        cell.dataset.head = h;
        row.append(cell);
      }
      table.append(row);
    }
  }

  /* ---- the grid of thumbnails ---- */

  function drawGrid() {
    const grid = $("grid");
    const [tr, tc] = D.thumb;
    const size = H > 8 ? 40 : 56; // px per thumbnail, smaller for many heads
    grid.style.setProperty("--thumb", size - 4 + "px");
    grid.style.gridTemplateColumns = "max-content repeat(" + H + ", " + size + "px)";
    grid.append(el("div", "label"));
    for (let h = 0; h < H; h++) grid.append(el("div", "label", (H > 8 ? "h" : "head ") + h));
    for (let l = 0; l < LAYERS; l++) {
      grid.append(el("div", "label", D.layers[l]));
      for (let h = 0; h < H; h++) {
        const cell = el("div", "cell");
        cell.dataset.layer = l;
        cell.dataset.head = h;
        const start = (l * H + h) * tr * tc;
        const canvas = paint(el("canvas", "thumb"), A.thumbs.subarray(start, start + tr * tc), tr, tc);
        canvas.dataset.layer = l;
        canvas.dataset.head = h;
        cell.append(canvas);
        const found = tags(l, h);
        if (found.length) cell.append(el("span", "badge", found.join(" ")));
        if (!slotOf.has(l + ":" + h)) cell.classList.add("nomap");
        cell.title = D.layers[l] + " head " + h + ": " + describe(l, h);
        grid.append(cell);
      }
    }
    if (A.rollout) {
      grid.append(el("div", "label", "rollout"));
      const cell = el("div", "cell");
      cell.dataset.kind = "rollout";
      const canvas = paint(el("canvas", "thumb"), A.rollout, R, K);
      canvas.id = "rollout-thumb";
      cell.append(canvas);
      cell.title = "attention rollout: every layer's heads averaged, with the residual, chained";
      grid.append(cell);
    }
  }

  /* ---- the chosen map ---- */

  function open(kind, layer, head) {
    Object.assign(state, { kind, layer, head, values: null, scales: null, rest: null });
    const view = $("view");
    view.dataset.kind = kind;
    view.dataset.layer = kind === "head" ? layer : "";
    view.dataset.head = kind === "head" ? head : "";
    for (const cell of document.querySelectorAll("#grid .cell")) {
      const match = kind === "rollout" ? cell.dataset.kind === "rollout"
        : cell.dataset.layer === String(layer) && cell.dataset.head === String(head);
      cell.classList.toggle("selected", match);
    }
    if (kind === "rollout") {
      $("view-title").textContent = "attention rollout (all layers, heads averaged)";
      $("view-stats").textContent = "how much each position draws on each input token through the layers";
      state.values = A.rollout;
      state.scales = A.rollout_scales;
    } else {
      $("view-title").textContent = D.layers[layer] + " \u00b7 head " + head;
      $("view-stats").textContent = describe(layer, head);
      const slot = slotOf.get(layer + ":" + head);
      if (slot === undefined) {
        $("view-stats").textContent += " \u00b7 full map not stored: rerun with --heads " + layer + ":" + head;
      } else {
        state.values = A.maps.subarray(slot * R * K, (slot + 1) * R * K);
        state.scales = A.map_scales.subarray(slot * R, (slot + 1) * R);
        if (A.map_rest) state.rest = A.map_rest.subarray(slot * R, (slot + 1) * R);
      }
    }
    drawMap();
    const token = state.token;
    clearHighlight();
    if (token && token.side === "query") highlightQuery(token.index);
    if (token && token.side === "key") highlightKey(token.index);
  }

  function labelWidth(ctx, labels) {
    let widest = 0;
    for (const label of labels) widest = Math.max(widest, ctx.measureText(label).width);
    return Math.min(140, Math.ceil(widest) + 6);
  }

  function drawMap() {
    const canvas = $("map");
    const mark = $("map-mark");
    if (!state.values) {
      canvas.width = canvas.height = mark.width = mark.height = 0;
      state.geom = null;
      return;
    }
    const cw = Math.max(1, Math.min(16, Math.floor(560 / K)));
    const ch = Math.max(1, Math.min(16, Math.floor(560 / R)));
    const ctx = canvas.getContext("2d");
    ctx.font = "11px monospace";
    const rowLabels = ch >= 9;
    const keyLabels = cw >= 9;
    const left = rowLabels ? labelWidth(ctx, D.rows.map((q) => D.queries[q])) : 0;
    const top = keyLabels ? labelWidth(ctx, D.keys) : 0;
    canvas.width = mark.width = left + K * cw;
    canvas.height = mark.height = top + R * ch;
    const cells = new Uint8Array(R * K);
    let peak = 0;
    for (let r = 0; r < R; r++) peak = Math.max(peak, state.scales[r] * 255);
    for (let r = 0; r < R; r++) {
      const factor = peak > 0 ? (state.scales[r] * 255) / peak : 0;
      for (let j = 0; j < K; j++) {
        const v = state.values[r * K + j];
        cells[r * K + j] = state.scale === "row" ? v : Math.round(v * factor);
      }
    }
    const image = paint(document.createElement("canvas"), cells, R, K);
    ctx.font = "11px monospace";
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(image, left, top, K * cw, R * ch);
    ctx.fillStyle = "#1d2430";
    ctx.textBaseline = "middle";
    if (rowLabels) {
      ctx.textAlign = "right";
      D.rows.forEach((q, r) => ctx.fillText(D.queries[q], left - 4, top + r * ch + ch / 2, left - 6));
    }
    if (keyLabels) {
      ctx.textAlign = "left";
      D.keys.forEach((label, j) => {
        ctx.save();
        ctx.translate(left + j * cw + cw / 2, top - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.fillText(label, 0, 0, top - 6);
        ctx.restore();
      });
    }
    state.geom = { left, top, cw, ch };
  }

  function markMap(row, key) {
    const mark = $("map-mark");
    const ctx = mark.getContext("2d");
    ctx.clearRect(0, 0, mark.width, mark.height);
    const g = state.geom;
    if (!g) return;
    ctx.strokeStyle = "rgb(" + ACCENT + ")";
    ctx.lineWidth = 2;
    if (row !== null) ctx.strokeRect(g.left, g.top + row * g.ch, K * g.cw, g.ch);
    if (key !== null) ctx.strokeRect(g.left + key * g.cw, g.top, g.cw, R * g.ch);
  }

  function cellAt(event) {
    const g = state.geom;
    if (!g) return null;
    const key = Math.floor((event.offsetX - g.left) / g.cw);
    const row = Math.floor((event.offsetY - g.top) / g.ch);
    return row >= 0 && row < R && key >= 0 && key < K ? { row, key } : null;
  }

  function weight(row, key) {
    return state.values[row * K + key] * state.scales[row];
  }

  /* ---- the token columns ---- */

  function drawTokens() {
    queryEls = D.queries.map((label, i) => {
      const node = el("div", "tok query" + (rowOf[i] < 0 ? " unstored" : ""), label);
      node.dataset.index = i;
      node.title = rowOf[i] < 0 ? "row not stored (--max-tokens)" : "query " + i;
      return node;
    });
    keyEls = D.keys.map((label, j) => {
      const node = el("div", "tok key", label);
      node.dataset.index = j;
      node.title = "key " + j;
      return node;
    });
    $("queries").append(...queryEls);
    $("keys").append(...keyEls);
    if (D.rest) {
      restEl = el("div", "tok rest", D.rest);
      restEl.title = "the keys left out of the maps, together (Whisper: the silence that pads its 30 s window)";
      $("keys").append(restEl);
    }
    $("queries").addEventListener("mouseover", (event) => {
      const node = event.target.closest(".tok");
      if (node) highlightQuery(Number(node.dataset.index));
    });
    $("keys").addEventListener("mouseover", (event) => {
      const node = event.target.closest(".tok");
      if (node) highlightKey(Number(node.dataset.index));
    });
  }

  function clearHighlight() {
    for (const node of queryEls.concat(keyEls, restEl ? [restEl] : [])) {
      node.classList.remove("active");
      node.style.background = "";
      delete node.dataset.weight;
    }
    $("lines").textContent = "";
    state.token = null;
    markMap(null, null);
  }

  function shade(node, value, peak) {
    node.dataset.weight = String(value);
    node.style.background = value > 0 ? "rgba(" + ACCENT + ", " + Math.min(1, 0.1 + 0.9 * (value / peak)).toFixed(3) + ")" : "";
  }

  function drawLines(from, targets, peak) {
    const svg = $("lines");
    const box = $("tokens");
    svg.textContent = "";
    svg.setAttribute("width", box.clientWidth);
    svg.setAttribute("height", box.scrollHeight);
    for (const [target, value] of targets) {
      if (value < peak / 100) continue; // under 1% of the strongest: not drawn
      const [q, k] = from.classList.contains("query") ? [from, target] : [target, from];
      const line = document.createElementNS("http://www.w3.org/2000/svg", "line");
      line.setAttribute("x1", q.offsetLeft + q.offsetWidth);
      line.setAttribute("y1", q.offsetTop + q.offsetHeight / 2);
      line.setAttribute("x2", k.offsetLeft);
      line.setAttribute("y2", k.offsetTop + k.offsetHeight / 2);
      line.setAttribute("stroke-width", (0.5 + 7.5 * value).toFixed(2));
      line.setAttribute("stroke-opacity", (0.15 + 0.85 * (value / peak)).toFixed(3));
      line.dataset.weight = String(value);
      svg.append(line);
    }
  }

  function top(pairs, labels) {
    return pairs.slice().sort((a, b) => b[1] - a[1]).slice(0, 5)
      .map(([node, value]) => JSON.stringify(labels[Number(node.dataset.index)]) + " " + value.toFixed(3)).join(", ");
  }

  function highlightQuery(i) {
    clearHighlight();
    state.token = { side: "query", index: i };
    queryEls[i].classList.add("active");
    const row = rowOf[i];
    if (!state.values) return;
    if (row < 0) {
      $("readout").textContent = "query " + i + ": its row is not stored (--max-tokens)";
      return;
    }
    const pairs = keyEls.map((node, j) => [node, weight(row, j)]);
    const peak = state.scales[row] * 255;
    for (const [node, value] of pairs) shade(node, value, peak || 1);
    drawLines(queryEls[i], pairs, peak);
    markMap(row, null);
    $("readout").textContent = "query " + i + " " + JSON.stringify(D.queries[i]) + " attends to " + top(pairs, D.keys);
    if (restEl && state.rest) {
      shade(restEl, state.rest[row], peak || 1);
      $("readout").textContent += "; " + state.rest[row].toFixed(3) + " on " + D.rest + " (not in the map)";
    }
  }

  function highlightKey(j) {
    clearHighlight();
    state.token = { side: "key", index: j };
    keyEls[j].classList.add("active");
    if (!state.values) return;
    const pairs = [];
    for (let r = 0; r < R; r++) pairs.push([queryEls[D.rows[r]], weight(r, j)]);
    const peak = Math.max(...pairs.map((pair) => pair[1]));
    for (const [node, value] of pairs) shade(node, value, peak || 1);
    drawLines(keyEls[j], pairs, peak);
    markMap(null, j);
    $("readout").textContent = "key " + j + " " + JSON.stringify(D.keys[j]) + " is attended by " + top(pairs, D.queries);
  }

  /* ---- wiring ---- */

  function wire() {
    $("grid").addEventListener("click", (event) => {
      const cell = event.target.closest(".cell");
      if (!cell) return;
      if (cell.dataset.kind === "rollout") open("rollout", null, null);
      else open("head", Number(cell.dataset.layer), Number(cell.dataset.head));
    });
    $("summary").addEventListener("click", (event) => {
      const cell = event.target.closest("td");
      if (cell) open("head", Number(cell.dataset.layer), Number(cell.dataset.head));
    });
    for (const input of document.querySelectorAll("input[name=scale]")) {
      input.addEventListener("change", () => {
        state.scale = input.value;
        const token = state.token;
        drawMap();
        if (token) (token.side === "query" ? highlightQuery : highlightKey)(token.index);
      });
    }
    $("map").addEventListener("mousemove", (event) => {
      const at = cellAt(event);
      if (!at) return;
      const q = D.rows[at.row];
      $("readout").textContent = "query " + q + " " + JSON.stringify(D.queries[q]) + " \u2192 key " + at.key + " " +
        JSON.stringify(D.keys[at.key]) + ": p = " + weight(at.row, at.key).toFixed(4);
    });
    $("map").addEventListener("click", (event) => {
      const at = cellAt(event);
      if (at) highlightQuery(D.rows[at.row]);
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape") clearHighlight();
    });
  }

  async function main() {
    $("title").textContent = D.title;
    $("note").textContent = [D.note, LAYERS + " layers \u00d7 " + H + " heads",
      "full maps of " + D.stored.length + " heads, " + R + " of " + Q + " query rows, " + K + " keys",
      "uint8 per row"].filter(Boolean).join(" \u00b7 ");
    const buffer = await inflate(D.blob);
    A = {
      map_scales: section(buffer, "map_scales", Float32Array),
      rollout_scales: section(buffer, "rollout_scales", Float32Array),
      map_rest: section(buffer, "map_rest", Float32Array),
      thumbs: section(buffer, "thumbs", Uint8Array),
      maps: section(buffer, "maps", Uint8Array),
      rollout: section(buffer, "rollout", Uint8Array),
    };
    drawGrid();
    drawSummary();
    drawTokens();
    wire();
    if (D.stored.length) open("head", D.stored[0][0], D.stored[0][1]);
    else if (A.rollout) open("rollout", null, null);
    document.body.dataset.ready = "1";
  }

  main().catch((error) => {
    $("view-title").textContent = "could not read the data: " + error;
    console.error(error);
  });
})();
