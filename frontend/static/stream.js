// The page's stream (/page/stream) and its API key: fetch with the key (EventSource cannot send
// one), ask for a key on 401, reconnect with backoff when the stream breaks.

import { sseEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);
const KEY = "nanoserve-api-key";

export function auth() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export function askForKey(why) {
  $("key-why").textContent = why || "This server wants an API key for its live data and its API.";
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// Streams frames to ``onFrame(event, data)``; ``onState(text)`` hears "live", "connecting…" and
// why it reconnects.
export class PageStream {
  constructor({ onFrame, onState }) {
    Object.assign(this, { onFrame, onState });
    this.controller = null;
    this.retry = 500;
    $("key-button").addEventListener("click", () => askForKey("The key is kept for this tab only."));
    $("key-cancel").addEventListener("click", () => $("key-dialog").close());
    $("key-form").addEventListener("submit", () => {
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY, key);
      else sessionStorage.removeItem(KEY);
      this.restart();
    });
  }

  restart() {
    this.controller?.abort();
    this.connect();
  }

  async connect() {
    this.controller = new AbortController();
    const mine = this.controller;
    this.onState("connecting…");
    try {
      const res = await fetch("/page/stream", { headers: auth(), signal: mine.signal, cache: "no-store" });
      if (res.status === 401) {
        this.onState("needs an API key");
        askForKey();
        return;
      }
      if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
      this.onState("live");
      this.retry = 500;
      for await (const { event, data } of sseEvents(res.body)) this.onFrame(event, JSON.parse(data));
      throw new Error("the stream ended");
    } catch (error) {
      if (mine.signal.aborted) return;
      this.onState(`reconnecting (${error.message})`);
      setTimeout(() => { if (this.controller === mine) this.connect(); }, this.retry);
      this.retry = Math.min(this.retry * 2, 5000);
    }
  }
}
