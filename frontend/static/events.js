// The events panel: the scheduler's events (they ride along with every snapshot, so a missed
// frame loses none) and this page's own (its link to the scheduler changing), newest first.

const MAX_LOCAL = 50;
const SHOWN = 60;

export class Events {
  constructor(list) {
    this.list = list;
    this.scheduler = new Map(); // seq -> event
    this.local = [];
  }

  fromSnapshot(events) {
    for (const e of events) this.scheduler.set(e.seq, e);
  }

  add(kind, text) {
    this.local.push({ time: Date.now() / 1000, kind, text });
    if (this.local.length > MAX_LOCAL) this.local.shift();
  }

  render() {
    const all = [...this.scheduler.values(), ...this.local].sort((a, b) => b.time - a.time).slice(0, SHOWN);
    this.list.replaceChildren(...all.map((e) => {
      const li = document.createElement("li");
      li.dataset.kind = e.kind;
      const time = document.createElement("time");
      time.textContent = new Date(e.time * 1000).toLocaleTimeString();
      const kind = document.createElement("span");
      kind.className = "kind";
      kind.textContent = e.kind;
      li.append(time, kind, e.text);
      return li;
    }));
  }
}
