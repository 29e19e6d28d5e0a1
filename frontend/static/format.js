// Small formatting helpers the page's panels share.

export function fmtAge(s) {
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function shortId(id) {
  return id.length > 22 ? `${id.slice(0, 14)}…${id.slice(-6)}` : id;
}

// A <dl>'s children from [term, text, class, data attributes] rows.
export function terms(rows) {
  return rows.flatMap(([term, text, cls = "", data = {}]) => {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = text;
    if (cls) dd.className = cls;
    Object.assign(dd.dataset, data);
    return [dt, dd];
  });
}
