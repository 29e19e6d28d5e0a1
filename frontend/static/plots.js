// The plots over the last minutes, one sample a second from the server (uPlot, vendored).

const PLOTS = [
  { title: "output tokens/s", series: [["tok/s", (s) => s.tok_s, "#3fb871"]] },
  { title: "TTFT (ms)", series: quantiles((s) => s.ttft_ms) },
  { title: "inter-token latency (ms)", series: quantiles((s) => s.itl_ms) },
  {
    title: "requests",
    series: [["running", (s) => s.running, "#3d7be0"], ["waiting", (s) => s.waiting, "#e0b03d"]],
  },
  { title: "KV usage (%)", series: [["held", (s) => pct(s.kv_usage), "#3d7be0"]], range: [0, 100] },
  { title: "preemptions/s", series: [["preempted", (s) => s.preempt_s, "#e0533d"]] },
  { title: "worker busy (%)", series: [["busy", (s) => pct(s.busy), "#b07be0"]], range: [0, 100] },
  { title: "prefix-cache hit rate (%)", series: [["hits", (s) => pct(s.hit_rate), "#2e8c83"]], range: [0, 100] },
];

function quantiles(get) {
  const colors = ["#3d7be0", "#e0b03d", "#e0533d"];
  return ["p50", "p90", "p99"].map((name, i) => [name, (s) => (get(s) ? get(s)[i] : null), colors[i]]);
}

// 24-hour clock times: an AM/PM label is too wide for a plot a quarter of the page wide.
function clock(u, splits) {
  const format = { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false };
  return splits.map((t) => new Date(t * 1000).toLocaleTimeString([], format));
}

function pct(x) {
  return x === null || x === undefined ? null : Math.round(x * 1000) / 10;
}

export class Plots {
  constructor(grid, keep = 600) {
    this.keep = keep;
    this.samples = [];
    this.charts = [];
    this.grid = grid;
    new ResizeObserver(() => this.resize()).observe(grid);
  }

  width() {
    const first = this.grid.querySelector(".plot");
    return Math.max(260, (first ? first.clientWidth : 300) - 4);
  }

  build() {
    if (this.charts.length || typeof uPlot === "undefined") return;
    for (const plot of PLOTS) {
      const box = document.createElement("div");
      box.className = "plot";
      const title = document.createElement("h3");
      title.textContent = plot.title;
      box.append(title);
      this.grid.append(box);
      const options = {
        width: 300,
        height: 130,
        legend: { show: true, live: false },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: plot.range ? { range: plot.range } : { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
        axes: [
          { stroke: "#8b95a3", grid: { stroke: "#2c323c" }, ticks: { stroke: "#2c323c" }, values: clock, space: 70 },
          { stroke: "#8b95a3", grid: { stroke: "#2c323c" }, ticks: { stroke: "#2c323c" }, size: 52 },
        ],
        series: [{}, ...plot.series.map(([label, , stroke]) => ({ label, stroke, width: 1.5, spanGaps: false }))],
      };
      const chart = new uPlot(options, this.data(plot), box);
      this.charts.push({ plot, chart });
    }
    this.resize();
  }

  data(plot) {
    const xs = this.samples.map((s) => s.t);
    return [xs, ...plot.series.map(([, get]) => this.samples.map((s) => get(s) ?? null))];
  }

  reset(samples) {
    this.samples = samples.slice(-this.keep);
    this.build();
    this.redraw();
  }

  push(sample) {
    this.samples.push(sample);
    if (this.samples.length > this.keep) this.samples.shift();
    this.redraw();
  }

  redraw() {
    if (document.hidden) return;
    for (const { plot, chart } of this.charts) chart.setData(this.data(plot));
  }

  resize() {
    const width = this.width();
    for (const { chart } of this.charts) chart.setSize({ width, height: 130 });
  }
}
