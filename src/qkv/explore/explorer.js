// qkv attention explorer: draws one "result" (a model's attention weights for one input, as JSON) in the page.
// Plain ES2020, no libraries. The data comes either embedded in the page (an exported file) or from the
// server's /api/attention (then the page also shows a form).
//
// Everything is drawn from `state` by the render* functions; event handlers change `state` and call them.
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const ROW = 18;            // head view: pixels per token row
  const GAP = 160;           // head view: width of the band the lines cross
  const THUMB = 72;          // model view: thumbnail size in pixels
  const MIN_WEIGHT = 0.01;   // head view: lighter lines are not drawn
  const IMAGE_SIZE = 336;    // image view: longer side of the scaled-up image
  const BLUE = [8, 48, 107]; // weight 1 in the white -> dark blue scale

  const state = {
    kind: null,      // the server's model kind (server mode): "image" sends an image instead of text
    result: null,
    view: null,      // the view shown (one of result.views)
    layer: 0,
    heads: [],       // heads[h]: is head h checked
    step: 0,         // output tokens shown, 1..n (when result.steps)
    query: 0,        // the query token whose attention the image overlay shows
    detail: null,    // {layer, head} of the clicked thumbnail, or null
  };

  // ---- small helpers ----

  function el(tag, attrs = {}, text) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svgEl(tag, attrs = {}) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    return node;
  }

  const range = (n) => Array.from({ length: Math.max(n, 0) }, (_, i) => i);

  function headColour(h, count) {
    return `hsl(${Math.round((h * 360) / Math.max(count, 1))}, 75%, 42%)`;
  }

  // Weight 0..1 -> [r, g, b] between white and dark blue.
  function weightRGB(w) {
    const t = Math.min(Math.max(w, 0), 1);
    return BLUE.map((c) => Math.round(255 + (c - 255) * t));
  }

  // One weight; 0 where a row is short or missing, so odd data draws instead of throwing.
  function weight(matrix, i, j) {
    const w = matrix && matrix[i] ? matrix[i][j] : 0;
    return typeof w === "number" && isFinite(w) ? w : 0;
  }

  const numLayers = (view) => view.attention.length;
  // a layer's name: its number, and what sets it apart where layers differ (Gemma's local and global layers)
  const layerName = (view, l) => (view.layers ? `${l} · ${view.layers[l]}` : String(l));
  const numHeads = (view) => (view.attention.length ? view.attention[0].length : 0);
  const matrixOf = (view, layer, head) => (view.attention[layer] || [])[head] || [];

  // Rough rendered width of a label at 12px: CJK characters are about twice as wide as Latin ones.
  function labelWidth(tokens) {
    let widest = 20;
    for (const token of tokens) {
      let w = 0;
      for (const ch of String(token)) w += ch.codePointAt(0) >= 0x2e80 ? 12.5 : 7;
      widest = Math.max(widest, w + 6);
    }
    return Math.ceil(widest);
  }

  // Query rows drawn: all of them, or for a stepped view those up to the current step.
  function visibleRows(view) {
    const steps = state.result.steps;
    const rows = view.queries.length;
    if (!view.stepped || !steps) return rows;
    return Math.max(0, Math.min(rows, steps.first + state.step));
  }

  // The row of the current step (highlighted), or -1.
  function currentRow(view) {
    const steps = state.result.steps;
    return view.stepped && steps ? steps.first + state.step - 1 : -1;
  }

  function showError(message) {
    $("error").textContent = message || "";
    $("error").hidden = !message;
  }

  const setStatus = (text) => { $("status").textContent = text; };

  // Runs fn; a failure shows in #error instead of leaving the page half drawn without a word.
  function safely(fn) {
    try {
      fn();
    } catch (err) {
      console.error(err);
      showError(`cannot show this result: ${err.message}`);
    }
  }

  // ---- a new result ----

  function setResult(result) {
    if (!result || !Array.isArray(result.views) || !result.views.length) {
      throw new Error("the result has no attention views");
    }
    state.result = result;
    state.step = result.steps && result.steps.tokens ? result.steps.tokens.length : 0;
    state.query = 0;
    state.detail = null;
    $("result").hidden = false;
    $("model-name").textContent = `${result.model} (${result.kind})`;
    fillSelect($("view"), result.views.map((v) => [v.id, v.title || v.id]));
    selectView(result.views[0]);
    setupSteps();
    renderAll();
  }

  function fillSelect(select, options) {
    select.textContent = "";
    for (const [value, text] of options) select.appendChild(el("option", { value }, String(text)));
  }

  // Makes `view` current: the layer list and the head toggles follow its shape.
  function selectView(view) {
    state.view = view;
    const layers = numLayers(view);
    const heads = numHeads(view);
    state.layer = Math.min(state.layer, Math.max(layers - 1, 0));
    if (state.heads.length !== heads) state.heads = range(heads).map(() => true);
    if (state.detail && (state.detail.layer >= layers || state.detail.head >= heads)) state.detail = null;
    state.query = Math.min(state.query, Math.max(view.queries.length - 1, 0));
    $("view").value = view.id;
    fillSelect($("layer"), range(layers).map((l) => [l, layerName(view, l)]));
    $("layer").value = String(state.layer);
    buildHeadToggles(heads);
  }

  function buildHeadToggles(count) {
    const box = $("heads");
    box.textContent = "";
    for (const h of range(count)) {
      const label = el("label", { class: "head", title: `head ${h}` });
      const toggle = el("input", { type: "checkbox", class: "head-toggle", "data-head": h });
      toggle.checked = state.heads[h];
      toggle.addEventListener("change", () => {
        state.heads[h] = toggle.checked;
        renderHeadView();
        renderImage();
      });
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = headColour(h, count);
      label.append(toggle, swatch, String(h));
      box.appendChild(label);
    }
  }

  function syncHeadToggles() {
    for (const box of document.querySelectorAll(".head-toggle")) box.checked = !!state.heads[+box.dataset.head];
  }

  function renderAll() {
    renderHeadView();
    renderModelView();
    renderDetail();
    renderSteps();
    renderImage();
  }

  // ---- head view: query tokens left, key tokens right, a line per (head, query, key) ----

  function renderHeadView() {
    const view = state.view;
    const box = $("head-view");
    box.textContent = "";
    const queries = view.queries;
    const keys = view.keys;
    const rows = visibleRows(view);
    const x1 = labelWidth(queries) + 6;  // where lines start
    const x2 = x1 + GAP;                 // where lines end
    const width = x2 + 6 + labelWidth(keys);
    const height = Math.max(queries.length, keys.length, 1) * ROW + 8;
    const y = (i) => 4 + ROW * i + ROW / 2;
    const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}` });

    const current = currentRow(view);
    if (current >= 0 && current < queries.length) {
      svg.appendChild(svgEl("rect", { class: "current-row", x: 0, y: y(current) - ROW / 2, width: x1, height: ROW }));
    }
    svg.appendChild(drawLines(view, rows, x1, x2, y));
    queries.forEach((token, i) => {
      const text = tokenText(token, "query-token", i, x1 - 4, y(i), "end");
      text.classList.toggle("future", i >= rows);
      text.classList.toggle("current", i === current);
      text.classList.toggle("selected", !!state.result.image && i === state.query);
      text.addEventListener("click", () => selectQuery(i));
      svg.appendChild(text);
    });
    keys.forEach((token, j) => svg.appendChild(tokenText(token, "key-token", j, x2 + 4, y(j), "start")));
    box.appendChild(svg);
  }

  function drawLines(view, rows, x1, x2, y) {
    const group = svgEl("g", { class: "lines" });
    const heads = state.heads.length;
    state.heads.forEach((on, h) => {
      if (!on) return;
      const matrix = matrixOf(view, state.layer, h);
      const colour = headColour(h, heads);
      for (let i = 0; i < rows; i++) {
        for (let j = 0; j < view.keys.length; j++) {
          const w = weight(matrix, i, j);
          if (w <= MIN_WEIGHT) continue;
          const line = svgEl("line", {
            class: "attn", x1, y1: y(i), x2, y2: y(j), stroke: colour, "stroke-opacity": Math.min(w, 1),
            "data-head": h, "data-query": i, "data-key": j, "data-weight": w,
          });
          line.appendChild(svgEl("title")).textContent = `head ${h}: ${w.toFixed(3)}`;
          group.appendChild(line);
        }
      }
    });
    return group;
  }

  // A token label; hovering it shows only its lines (data-query or data-key equal to its index).
  function tokenText(token, cls, index, x, y, anchor) {
    const text = svgEl("text", { class: cls, "data-index": index, x, y, "text-anchor": anchor, "dominant-baseline": "central" });
    text.textContent = token;
    const attr = cls === "query-token" ? "query" : "key";
    text.addEventListener("mouseenter", () => focusLines(text, attr, index));
    text.addEventListener("mouseleave", () => focusLines(text, attr, null));
    return text;
  }

  function focusLines(text, attr, index) {
    const svg = text.ownerSVGElement;
    text.classList.toggle("hover", index !== null);
    for (const line of svg.querySelectorAll("line.attn")) {
      line.classList.toggle("dim", index !== null && line.dataset[attr] !== String(index));
    }
  }

  // ---- model view: a heatmap thumbnail per layer and head ----

  function renderModelView() {
    const view = state.view;
    const box = $("model-view");
    box.textContent = "";
    const heads = numHeads(view);
    const grid = el("div", { class: "grid" });
    grid.style.gridTemplateColumns = `auto repeat(${heads}, ${THUMB}px)`;
    grid.appendChild(el("span"));
    for (const h of range(heads)) grid.appendChild(el("span", { class: "col-label" }, `head ${h}`));
    const rows = visibleRows(view);
    for (const l of range(numLayers(view))) {
      grid.appendChild(el("span", { class: "row-label" }, `layer ${layerName(view, l)}`));
      for (const h of range(heads)) {
        const canvas = el("canvas", {
          class: "thumb", "data-layer": l, "data-head": h, width: THUMB, height: THUMB, title: `layer ${l}, head ${h}`,
        });
        drawHeatmap(canvas, matrixOf(view, l, h), rows, view.queries.length, view.keys.length);
        canvas.addEventListener("click", () => selectHead(l, h));
        grid.appendChild(canvas);
      }
    }
    box.appendChild(grid);
    markSelectedThumb();
  }

  // Draws the first `rows` of a tq x tk matrix one pixel per weight, then scales it up to the canvas.
  function drawHeatmap(canvas, matrix, rows, tq, tk) {
    const small = document.createElement("canvas");
    small.width = Math.max(tk, 1);
    small.height = Math.max(tq, 1);
    const image = small.getContext("2d").createImageData(small.width, small.height);
    for (let i = 0; i < rows; i++) {
      for (let j = 0; j < tk; j++) {
        const at = (i * small.width + j) * 4;
        image.data.set([...weightRGB(weight(matrix, i, j)), 255], at);
      }
    }
    small.getContext("2d").putImageData(image, 0, 0);  // rows not drawn stay transparent (grey background)
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.drawImage(small, 0, 0, canvas.width, canvas.height);
  }

  function markSelectedThumb() {
    const d = state.detail;
    for (const thumb of document.querySelectorAll("#model-view .thumb")) {
      thumb.classList.toggle("selected", !!d && +thumb.dataset.layer === d.layer && +thumb.dataset.head === d.head);
    }
  }

  // A click on a thumbnail: its weights as a table, and the head view switches to that layer and head.
  function selectHead(layer, head) {
    state.detail = { layer, head };
    state.layer = layer;
    state.heads = state.heads.map((_, h) => h === head);
    $("layer").value = String(layer);
    syncHeadToggles();
    renderHeadView();
    renderDetail();
    renderImage();
    markSelectedThumb();
  }

  // ---- detail: one head's weights as numbers ----

  function renderDetail() {
    const box = $("detail");
    const d = state.detail;
    box.hidden = !d;
    if (!d) return;
    const view = state.view;
    const matrix = matrixOf(view, d.layer, d.head);
    $("detail-title").textContent = `layer ${d.layer}, head ${d.head}`;
    const table = $("detail-table");
    table.textContent = "";
    const header = table.createTHead().insertRow();
    header.appendChild(el("th"));
    for (const key of view.keys) header.appendChild(el("th", { class: "key" }, key));
    const body = table.createTBody();
    const current = currentRow(view);
    for (let i = 0; i < visibleRows(view); i++) {
      const row = body.insertRow();
      if (i === current) row.className = "current";
      row.appendChild(el("th", {}, view.queries[i]));
      view.keys.forEach((_, j) => row.appendChild(weightCell(weight(matrix, i, j), i, j)));
    }
  }

  function weightCell(w, i, j) {
    const td = el("td", { "data-query": i, "data-key": j }, w.toFixed(3));
    td.style.background = `rgb(${weightRGB(w).join(",")})`;
    if (w > 0.5) td.className = "dark";
    return td;
  }

  // ---- steps: the output so far and each step's candidates ----

  function setupSteps() {
    const steps = state.result.steps;
    const n = steps && steps.tokens ? steps.tokens.length : 0;
    $("steps").hidden = n === 0;
    if (!n) return;
    const slider = $("step");
    slider.min = "1";
    slider.max = String(n);
    slider.value = String(state.step);
    document.querySelector(".step-row").hidden = n === 1;  // one step (a class): nothing to slide over
  }

  function renderSteps() {
    const steps = state.result.steps;
    if (!steps || !steps.tokens || !steps.tokens.length) return;
    const s = state.step;
    const n = steps.tokens.length;
    $("step-label").textContent = `step ${s} of ${n}`;
    const text = $("step-text");
    text.textContent = "";
    if (state.result.kind === "lm") text.appendChild(el("span", { class: "prompt" }, state.result.input));
    steps.tokens.slice(0, s).forEach((token, k) => {
      text.appendChild(el("span", { class: k === s - 1 ? "tok current" : "tok" }, token));
    });
    const list = $("topk");
    list.textContent = "";
    const chosen = steps.tokens[s - 1];
    for (const candidate of (steps.top && steps.top[s - 1]) || []) {
      const li = el("li", candidate.token === chosen ? { class: "chosen", title: "chosen" } : {});
      const bar = el("span", { class: "bar" });
      bar.style.width = `${Math.round(candidate.p * 60)}px`;
      li.append(el("span", { class: "cand" }, candidate.token), bar,
        el("span", { class: "p" }, `${(candidate.p * 100).toFixed(1)}%`));
      list.appendChild(li);
    }
  }

  function setStep(s) {
    state.step = s;
    renderSteps();
    renderHeadView();
    if (state.view.stepped) {
      renderModelView();
      renderDetail();
    }
  }

  // ---- image: attention from one query token to the patches, over the picture ----

  const picture = { src: null, img: null };

  function selectQuery(i) {
    if (!state.result.image) return;
    state.query = i;
    for (const text of document.querySelectorAll("#head-view .query-token")) {
      text.classList.toggle("selected", +text.dataset.index === i);
    }
    renderImage();
  }

  function renderImage() {
    const info = state.result.image;
    $("image-view").hidden = !info;
    if (!info) return;
    if (picture.src !== info.src) {  // a new picture: draw once it has loaded
      picture.src = info.src;
      picture.img = new Image();
      picture.img.onload = () => safely(renderImage);
      picture.img.src = info.src;
    }
    const img = picture.img;
    if (!img.complete || !img.naturalWidth) return;
    const canvas = $("image-canvas");
    const scale = IMAGE_SIZE / Math.max(img.naturalWidth, img.naturalHeight);
    canvas.width = Math.round(img.naturalWidth * scale);
    canvas.height = Math.round(img.naturalHeight * scale);
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
    const heat = patchWeights(info);
    if (heat) drawHeat(ctx, heat, info.grid, canvas.width, canvas.height);
  }

  // The current query's attention to the patches, averaged over the checked heads, max 1; null when there is
  // nothing to show (the reason goes in the caption).
  function patchWeights(info) {
    const view = state.view;
    const [rows, cols] = info.grid;
    const first = info.first_patch;
    const caption = $("image-caption");
    const heads = range(state.heads.length).filter((h) => state.heads[h]);
    if (first + rows * cols > view.keys.length) {
      caption.textContent = `the ${rows}×${cols} patches are not among this view's keys`;
      return null;
    }
    if (!heads.length) {
      caption.textContent = "no heads selected";
      return null;
    }
    const sums = range(rows * cols).map((p) => {
      let sum = 0;
      for (const h of heads) sum += weight(matrixOf(view, state.layer, h), state.query, first + p);
      return sum / heads.length;
    });
    const max = Math.max(...sums);
    caption.textContent = `attention from “${view.queries[state.query]}”, layer ${state.layer}, ` +
      `${heads.length} head${heads.length > 1 ? "s" : ""} (click a query token to change)`;
    return max > 0 ? sums.map((v) => v / max) : sums;
  }

  // Semi-transparent red-yellow cells: stronger attention is redder and more opaque.
  function drawHeat(ctx, heat, grid, width, height) {
    const [rows, cols] = grid;
    const cw = width / cols;
    const ch = height / rows;
    heat.forEach((v, p) => {
      const r = Math.floor(p / cols);
      const c = p % cols;
      ctx.fillStyle = `rgba(255, ${Math.round(220 * (1 - v))}, 0, ${(0.7 * v).toFixed(3)})`;
      ctx.fillRect(c * cw, r * ch, cw, ch);
    });
  }

  // ---- server mode ----

  // fetch + JSON; a status other than 200 becomes an Error with the server's one-line message.
  async function callApi(url, options) {
    const response = await fetch(url, options);
    let body = null;
    try {
      body = await response.json();
    } catch (err) {
      body = null;  // not JSON: reported below
    }
    if (!response.ok) throw new Error((body && body.error) || `${response.status} ${response.statusText}`);
    if (body === null) throw new Error(`${url}: the server's answer is not JSON`);
    return body;
  }

  async function loadInfo() {
    try {
      const info = await callApi("/api/info");
      $("model-name").textContent = `${info.model} (${info.kind})`;
      if (info.input_label) $("input-label").textContent = info.input_label;
      if (info.max_chars) $("input").maxLength = info.max_chars;
      if (info.example && !$("input").value) $("input").value = info.example;
      state.kind = info.kind;
      if (info.kind === "image") {  // an image model: a file to open instead of text (the example is a data URL)
        $("input").hidden = true;
        $("image-input").hidden = false;
      }
    } catch (err) {
      showError(`cannot reach the server: ${err.message}`);
    }
  }

  async function run() {
    const button = $("run");
    if (button.disabled) return;
    button.disabled = true;
    setStatus("running…");
    try {
      const request = state.kind === "image" ? { image: await chosenImage() } : { text: $("input").value };
      const result = await callApi("/api/attention", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(request),
      });
      showError("");
      safely(() => setResult(result));
    } catch (err) {
      showError(err.message);  // the previous result stays
    } finally {
      button.disabled = false;
      setStatus("");
    }
  }

  // The opened image file as a data URL, or the server's example image when none is open.
  function chosenImage() {
    const file = $("image-file").files[0];
    if (!file) return Promise.resolve($("input").value);
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(new Error(`cannot read ${file.name}`));
      reader.readAsDataURL(file);
    });
  }

  // ---- start ----

  function wireControls() {
    $("view").addEventListener("change", () => safely(() => {
      selectView(state.result.views.find((v) => v.id === $("view").value));
      renderAll();
    }));
    $("layer").addEventListener("change", () => {
      state.layer = +$("layer").value;
      renderHeadView();
      renderImage();
    });
    const setAll = (on) => {
      state.heads = state.heads.map(() => on);
      syncHeadToggles();
      renderHeadView();
      renderImage();
    };
    $("all-heads").addEventListener("click", () => setAll(true));
    $("no-heads").addEventListener("click", () => setAll(false));
    $("step").addEventListener("input", () => setStep(+$("step").value));
    $("run").addEventListener("click", run);
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
        e.preventDefault();
        run();
      }
    });
  }

  function init() {
    wireControls();
    let data;
    try {
      data = JSON.parse($("qkv-data").textContent);
    } catch (err) {
      showError(`cannot read the data in this page: ${err.message}`);
      return;
    }
    if (data === null) {
      loadInfo();
    } else {
      $("form").style.display = "none";
      safely(() => setResult(data));
    }
  }

  init();
})();
