// The KV pool on a canvas: one cell per block, coloured by state (free, cached-free, held, shared)
// and, for held blocks, shaded by owner. A pool too large for cells of a few pixels is drawn as a
// density view: each cell stands for a range of blocks, filled in proportion to their states.
// The pool arrives run-length encoded: runs = [state, owner set, length, ...] in block order.

export const STATE_NAMES = ["free", "cached-free", "held", "shared"];
const FREE = 0, CACHED = 1, HELD = 2, SHARED = 3;
const COLORS = { [FREE]: "#2a3039", [CACHED]: "#2e8c83", [HELD]: "#3d7be0", [SHARED]: "#f0a030" };
const MIN_CELL = 4; // below this many pixels a block is drawn in the density view
const MAX_CELL = 26;

export function ownerColor(index) {
  // Blues around the held colour, one shade per running request, so neighbours differ.
  const hue = 200 + ((index * 37) % 50);
  const light = 42 + ((index * 23) % 22);
  return `hsl(${hue} 72% ${light}%)`;
}

export class PoolMap {
  constructor(canvas, tooltip) {
    this.canvas = canvas;
    this.tooltip = tooltip;
    this.pool = null;
    this.requests = [];
    this.highlight = null; // a request index whose blocks are outlined
    this.layout = null;
    canvas.addEventListener("mousemove", (e) => this.hover(e));
    canvas.addEventListener("mouseleave", () => { this.tooltip.hidden = true; });
  }

  // Per-block arrays from the runs: state and owner set, plus the counts of each state.
  decode(pool) {
    const n = pool.num_blocks;
    const state = new Uint8Array(n);
    const owners = new Uint32Array(n);
    const counts = [0, 0, 0, 0];
    let at = 0;
    const runs = pool.runs;
    for (let i = 0; i + 2 < runs.length; i += 3) {
      const s = runs[i], o = runs[i + 1], len = runs[i + 2];
      state.fill(s, at, at + len);
      owners.fill(o, at, at + len);
      counts[s] += len;
      at += len;
    }
    return { state, owners, counts };
  }

  update(pool, requests) {
    this.pool = pool;
    this.requests = requests;
    this.blocks = pool ? this.decode(pool) : null;
    this.draw();
    return this.blocks ? this.blocks.counts : null;
  }

  measure(n) {
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(200, this.canvas.clientWidth || this.canvas.parentElement.clientWidth);
    const maxHeight = Math.max(160, Math.min(window.innerHeight * 0.45, 420));
    let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(1, n)));
    cell = Math.min(MAX_CELL, cell);
    if (cell >= MIN_CELL) {
      const cols = Math.floor(width / cell);
      return { dpr, width, cell, cols, rows: Math.ceil(n / cols), per: 1 };
    }
    cell = MIN_CELL + 2; // density: each cell covers `per` blocks
    const cols = Math.floor(width / cell);
    const rows = Math.floor(maxHeight / cell);
    const per = Math.ceil(n / (cols * rows));
    return { dpr, width, cell, cols, rows: Math.ceil(n / per / cols), per };
  }

  draw() {
    const ctx = this.canvas.getContext("2d");
    if (!this.pool) {
      this.canvas.height = 0;
      this.canvas.dataset.drawn = "none";
      return;
    }
    const n = this.pool.num_blocks;
    const L = (this.layout = this.measure(n));
    this.canvas.width = Math.round(L.width * L.dpr);
    this.canvas.height = Math.round(L.rows * L.cell * L.dpr);
    this.canvas.style.height = `${L.rows * L.cell}px`;
    ctx.setTransform(L.dpr, 0, 0, L.dpr, 0, 0);
    ctx.fillStyle = "#161a20";
    ctx.fillRect(0, 0, L.width, L.rows * L.cell);
    if (L.per === 1) this.drawBlocks(ctx, L);
    else this.drawDensity(ctx, L);
    const c = this.blocks.counts;
    this.canvas.dataset.drawn = L.per === 1 ? "blocks" : "density";
    this.canvas.dataset.held = String(c[HELD]);
    this.canvas.dataset.shared = String(c[SHARED]);
    this.canvas.dataset.cached = String(c[CACHED]);
    this.canvas.dataset.free = String(c[FREE]);
  }

  drawBlocks(ctx, L) {
    const { state, owners } = this.blocks;
    const gap = L.cell >= 7 ? 1 : 0;
    const sets = this.pool.owner_sets;
    const shade = sets.map((set) => (set.length === 1 ? ownerColor(set[0]) : COLORS[SHARED]));
    for (let b = 0; b < state.length; b++) {
      const x = (b % L.cols) * L.cell, y = Math.floor(b / L.cols) * L.cell;
      const s = state[b];
      ctx.fillStyle = s === HELD ? shade[owners[b]] : COLORS[s];
      ctx.fillRect(x, y, L.cell - gap, L.cell - gap);
    }
    if (this.highlight !== null) {
      ctx.strokeStyle = "#ffffff";
      ctx.lineWidth = 1.5;
      for (let b = 0; b < state.length; b++) {
        if (state[b] >= HELD && sets[owners[b]].includes(this.highlight)) {
          const x = (b % L.cols) * L.cell, y = Math.floor(b / L.cols) * L.cell;
          ctx.strokeRect(x + 0.75, y + 0.75, L.cell - gap - 1.5, L.cell - gap - 1.5);
        }
      }
    }
  }

  drawDensity(ctx, L) {
    const { state } = this.blocks;
    const inner = L.cell - 1;
    for (let c = 0; c * L.per < state.length; c++) {
      const from = c * L.per, to = Math.min(state.length, from + L.per);
      const k = [0, 0, 0, 0];
      for (let b = from; b < to; b++) k[state[b]]++;
      const x = (c % L.cols) * L.cell, y = Math.floor(c / L.cols) * L.cell;
      let filled = 0;
      for (const s of [SHARED, HELD, CACHED, FREE]) {
        const h = (k[s] / (to - from)) * inner;
        ctx.fillStyle = COLORS[s];
        ctx.fillRect(x, y + inner - filled - h, inner, h);
        filled += h;
      }
    }
  }

  hover(event) {
    const L = this.layout;
    if (!L || !this.pool) return;
    const rect = this.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / L.cell);
    const row = Math.floor((event.clientY - rect.top) / L.cell);
    const cellIndex = row * L.cols + col;
    if (col >= L.cols || cellIndex * L.per >= this.pool.num_blocks) {
      this.tooltip.hidden = true;
      return;
    }
    this.tooltip.textContent = L.per === 1 ? this.describeBlock(cellIndex) : this.describeRange(cellIndex * L.per, L.per);
    this.tooltip.hidden = false;
    const x = Math.min(event.clientX - rect.left + 14, rect.width - 240);
    this.tooltip.style.left = `${Math.max(0, x)}px`;
    this.tooltip.style.top = `${event.clientY - rect.top + 14}px`;
  }

  describeBlock(b) {
    const s = this.blocks.state[b];
    const holders = this.pool.owner_sets[this.blocks.owners[b]];
    const lines = [`block ${b} · ${STATE_NAMES[s]} · refs ${holders.length}`];
    if (s === CACHED) lines.push("no holder; its K/V kept for a prefix-cache hit");
    if (s === FREE) lines.push("nothing worth keeping");
    for (const index of holders.slice(0, 8)) {
      const r = this.requests[index];
      if (r) lines.push(`${r.request_id} (slot ${r.slot})`);
    }
    if (holders.length > 8) lines.push(`… and ${holders.length - 8} more`);
    return lines.join("\n");
  }

  describeRange(from, per) {
    const to = Math.min(this.pool.num_blocks, from + per);
    const k = [0, 0, 0, 0];
    for (let b = from; b < to; b++) k[this.blocks.state[b]]++;
    return `blocks ${from}–${to - 1} (density view)\n` +
      STATE_NAMES.map((name, s) => `${name}: ${k[s]}`).join(" · ");
  }
}

// The ledger bar: held, shared, cached-free and free blocks in proportion, with the watermark:
// admission stops where only the reserve is left free.
export function drawLedgerBar(bar, pool, counts) {
  bar.replaceChildren();
  if (!pool) return;
  const n = pool.num_blocks;
  for (const s of [HELD, SHARED, CACHED, FREE]) {
    const span = document.createElement("span");
    span.style.width = `${(100 * counts[s]) / n}%`;
    span.style.background = COLORS[s];
    bar.append(span);
  }
  const mark = document.createElement("div");
  mark.className = "mark";
  mark.style.left = `${(100 * (n - pool.watermark_blocks)) / n}%`;
  bar.append(mark);
  bar.title = `watermark: ${pool.watermark_blocks} blocks held back at admission ` +
    `(new requests wait once fewer than that many would stay free)`;
}

export function legend(el) {
  el.replaceChildren();
  const entries = [[FREE, "free"], [CACHED, "cached-free (prefix cache)"], [HELD, "held (shade = owner)"], [SHARED, "shared (several holders)"]];
  for (const [s, text] of entries) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = COLORS[s];
    item.append(swatch, text);
    el.append(item);
  }
  const mark = document.createElement("span");
  mark.textContent = "│ watermark: admission stops here";
  el.append(mark);
}
