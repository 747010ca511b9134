// Talking to the server: every API call goes through `api()`, which adds the API key (kept only
// in this tab's sessionStorage) and, on a 401, asks for the key once and tries again.

const KEY_NAME = "inferengine.apiKey";
let askForKey = null; // set by app.js: (message) => a promise that resolves once a key is set

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_NAME, key);
  else sessionStorage.removeItem(KEY_NAME);
}

export function onKeyNeeded(ask) {
  askForKey = ask;
}

/** fetch(path) with the key; a 401 asks for the key (once for every caller) and retries. */
export async function api(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401 || askForKey === null) return response;
    await askForKey(key ? "The server refused that key." : "This server needs an API key.");
  }
}

/** The error message of a failed response (OpenAI's error shape, or its status line). */
export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`.trim();
  }
}

/** The JSON payloads of a server-sent-event stream, until `[DONE]` or its end. */
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}
