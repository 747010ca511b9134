// The chat playground: one conversation streamed from /v1/chat/completions, with its settings.

import { api, errorMessage, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const EXAMPLE_SCHEMA = {
  type: "object",
  properties: { answer: { type: "string" }, confidence: { type: "number" } },
  required: ["answer"],
};

const SLIDERS = ["temperature", "top-p"];
const history = []; // the conversation sent back each turn: {role, content}
let controller = null; // the AbortController of the reply streaming now
let conversation = 0; // counts Clear: a reply cut by it is not added to the new conversation

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function setupChat() {
  // Temperature and top-p are sent only once moved: until then the server's defaults apply
  // (the model's generation_config.json, or --generation-config).
  for (const name of SLIDERS) {
    $(name).addEventListener("input", () => {
      $(name).dataset.set = "1";
      $(`${name}-value`).value = $(name).value;
      $("reset-sampling").hidden = false;
    });
  }
  $("reset-sampling").addEventListener("click", () => {
    for (const name of SLIDERS) {
      delete $(name).dataset.set;
      $(`${name}-value`).value = "model default";
    }
    $("reset-sampling").hidden = true;
  });
  $("json-schema").value = JSON.stringify(EXAMPLE_SCHEMA, null, 2);
  $("json-mode").addEventListener("change", () => ($("json-schema").hidden = !$("json-mode").checked));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!controller) send();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", clear);
  loadModels();
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    const { data } = await response.json();
    select.replaceChildren();
    const bases = data.filter((m) => !m.parent);
    const adapters = data.filter((m) => m.parent);
    for (const model of bases) select.append(new Option(model.id, model.id));
    if (adapters.length) {
      const group = el("optgroup");
      group.label = "Adapters";
      for (const a of adapters) group.append(new Option(`${a.id} (on ${a.parent})`, a.id));
      select.append(group);
    }
    select.disabled = data.length < 2;
  } catch (error) {
    showError(`Could not list the models: ${error.message}`);
  }
}

function showError(message) {
  const node = $("composer-error");
  node.textContent = message;
  node.hidden = !message;
}

function clear() {
  conversation += 1;
  controller?.abort();
  history.length = 0;
  const messages = $("messages");
  messages.replaceChildren(el("p", "empty-hint", "Conversation cleared."));
  showError("");
}

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("temperature").dataset.set) body.temperature = Number($("temperature").value);
  if ($("top-p").dataset.set) body.top_p = Number($("top-p").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  if ($("json-mode").checked) {
    let schema;
    try {
      schema = JSON.parse($("json-schema").value);
    } catch (error) {
      throw new Error(`The JSON schema is not valid JSON: ${error.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema } };
  }
  return body;
}

/** Run `change`, then keep the conversation scrolled to its end if it was there before. */
function keepAtEnd(change) {
  const box = $("messages");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  change();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

function addMessage(role, content) {
  const messages = $("messages");
  messages.querySelector(".empty-hint")?.remove();
  const node = el("div", `message ${role}`);
  node.append(el("div", "role", role === "user" ? "You" : "Assistant"));
  const body = el("div", "content");
  node.append(body);
  if (role === "user") body.textContent = content;
  messages.append(node);
  messages.scrollTop = messages.scrollHeight;
  return node;
}

function copyButton(getText) {
  const button = el("button", "copy link-button", "Copy");
  button.type = "button";
  button.addEventListener("click", async () => {
    await copyText(getText());
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1200);
  });
  return button;
}

async function copyText(value) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(value);
      return;
    } catch {
      // fall through: the clipboard API may be refused (no focus, no permission)
    }
  }
  const area = el("textarea");
  area.value = value;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

/** One assistant reply being streamed: its text, its reasoning and its numbers. */
class Reply {
  constructor() {
    this.node = addMessage("assistant");
    this.content = "";
    this.reasoning = "";
    this.chunks = 0;
    this.started = performance.now();
    this.firstToken = null;
    this.usage = null;
    this.finish = null;
    this.scheduled = false;
    this.body = this.node.querySelector(".content");
    this.body.classList.add("streaming");
  }

  add(delta) {
    if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
    if (delta.content) this.content += delta.content;
    if (delta.content || delta.reasoning_content) {
      this.chunks += 1;
      this.firstToken ??= performance.now();
      this.render();
    }
  }

  render() {
    if (this.scheduled) return;
    this.scheduled = true;
    requestAnimationFrame(() => {
      this.scheduled = false;
      this.draw();
    });
  }

  draw() {
    keepAtEnd(() => this.drawNow());
  }

  drawNow() {
    if (this.reasoning) {
      let details = this.node.querySelector(".reasoning");
      if (!details) {
        details = el("details", "reasoning");
        details.open = true;
        details.append(el("summary", "", "Reasoning"), el("div", "reasoning-text"));
        this.body.before(details);
      }
      details.querySelector(".reasoning-text").textContent = this.reasoning;
      if (this.content && this.body.classList.contains("streaming")) details.open = false;
    }
    this.body.replaceChildren(renderMarkdown(this.content));
  }

  end(note) {
    this.draw();
    this.body.classList.remove("streaming");
    const ended = performance.now();
    const parts = [];
    const usage = this.usage;
    if (usage) {
      parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    } else if (this.chunks) {
      parts.push(`≈${this.chunks} tokens`);
    }
    const generated = usage ? usage.completion_tokens : this.chunks;
    if (this.firstToken !== null) {
      parts.push(`first token ${((this.firstToken - this.started) / 1000).toFixed(2)} s`);
      const seconds = (ended - this.firstToken) / 1000;
      if (generated > 1 && seconds > 0) {
        parts.push(`${((generated - 1) / seconds).toFixed(1)} tokens/s`);
      }
    }
    if (this.finish && this.finish !== "stop") parts.push(`finish: ${this.finish}`);
    if (note) parts.push(note);
    const footer = el("div", "meta");
    footer.append(el("span", "stats", parts.join(" · ")), copyButton(() => this.content));
    keepAtEnd(() => this.node.append(footer));
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  showError("");
  let body;
  history.push({ role: "user", content: text });
  try {
    body = requestBody();
  } catch (error) {
    history.pop();
    showError(error.message);
    return;
  }
  const userNode = addMessage("user", text);
  $("prompt").value = "";
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const reply = new Reply();
  const started = conversation;
  let failure = null;
  try {
    await stream(body, reply, controller.signal);
  } catch (error) {
    failure = error.name === "AbortError" ? "stopped" : error;
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  if (started !== conversation) return; // cleared meanwhile
  if (failure instanceof Error && !reply.content) {
    reply.node.remove();
    userNode.classList.add("failed");
    history.pop(); // not answered: the next turn does not send it; the text goes back
    $("prompt").value = text;
    showError(failure.message);
    return;
  }
  history.push({ role: "assistant", content: reply.content });
  reply.end(failure === null ? "" : failure === "stopped" ? "stopped" : `error: ${failure.message}`);
  if (failure === "stopped") reply.node.classList.add("stopped");
}

async function stream(body, reply, signal) {
  const response = await api("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const event of sseEvents(response)) {
    if (event.error) throw new Error(event.error.message || "the stream failed");
    if (event.usage) reply.usage = event.usage;
    for (const choice of event.choices || []) {
      reply.add(choice.delta || {});
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    }
  }
}
