// The chat: the user's own conversation, streamed through the same OpenAI API clients use
// (/v1/chat/completions), with the API key when one was entered. Text goes in with
// textContent only, never as HTML.

import { sseEvents } from "./sse.js";

export class Chat {
  constructor({ log, form, input, temperature, maxTokens, send, clear, auth, onUnauthorized }) {
    Object.assign(this, { log, form, input, temperature, maxTokens, send, clear, auth, onUnauthorized });
    this.messages = [];
    this.model = null;
    this.controller = null;
    form.addEventListener("submit", (e) => { e.preventDefault(); this.submit(); });
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.submit(); }
    });
    clear.addEventListener("click", () => this.reset());
  }

  reset() {
    this.controller?.abort();
    this.messages = [];
    this.log.replaceChildren();
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    this.log.append(div);
    this.log.scrollTop = this.log.scrollHeight;
    return div;
  }

  async modelName() {
    if (this.model) return this.model;
    const res = await fetch("/v1/models", { headers: this.auth() });
    if (res.status === 401) throw new Unauthorized();
    const body = await res.json();
    this.model = body.data[0].id;
    return this.model;
  }

  async submit() {
    if (this.controller) { this.controller.abort(); return; } // the button stops a reply
    const text = this.input.value.trim();
    if (!text) return;
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.bubble("user", text);
    const reply = this.bubble("assistant", "");
    reply.dataset.state = "streaming";
    this.controller = new AbortController();
    this.send.textContent = "Stop";
    let answer = "";
    try {
      const body = {
        model: await this.modelName(),
        messages: this.messages,
        stream: true,
        temperature: Number(this.temperature.value),
        max_tokens: Number(this.maxTokens.value),
      };
      const res = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...this.auth() },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      if (res.status === 401) throw new Unauthorized();
      if (!res.ok) throw new Error((await res.json()).error?.message || res.statusText);
      for await (const event of sseEvents(res.body)) {
        if (event.data === "[DONE]") break;
        const chunk = JSON.parse(event.data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta?.content || "";
        answer += delta;
        reply.textContent = answer;
        this.log.scrollTop = this.log.scrollHeight;
      }
      reply.dataset.state = "done";
      this.messages.push({ role: "assistant", content: answer });
    } catch (error) {
      reply.dataset.state = "error";
      if (error instanceof Unauthorized) {
        reply.remove();
        this.messages.pop();
        this.onUnauthorized();
      } else if (error.name === "AbortError") {
        reply.textContent = answer + " [stopped]";
        this.messages.push({ role: "assistant", content: answer });
      } else {
        reply.classList.add("error");
        reply.textContent = `${answer}\n[error: ${error.message}]`;
        this.messages.pop();
      }
    } finally {
      this.controller = null;
      this.send.textContent = "Send";
    }
  }
}

class Unauthorized extends Error {}
