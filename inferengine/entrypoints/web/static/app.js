// The page's entry: the two tabs, the API-key dialog, and starting the chat and the engine view.

import { apiKey, onKeyNeeded, setApiKey } from "./api.js";
import { setupChat } from "./chat.js";
import { setupEngineView } from "./engine_view.js";

const $ = (id) => document.getElementById(id);

function setupTabs() {
  const tabs = [$("tab-chat"), $("tab-engine")];
  const show = (active) => {
    for (const tab of tabs) {
      const selected = tab === active;
      tab.setAttribute("aria-selected", String(selected));
      $(tab.getAttribute("aria-controls")).hidden = !selected;
    }
    window.location.hash = active === tabs[1] ? "engine" : "";
  };
  tabs.forEach((tab) => tab.addEventListener("click", () => show(tab)));
  if (window.location.hash === "#engine") show(tabs[1]);
}

function setupKeyDialog() {
  let pending = null; // one question for every request that got a 401 meanwhile
  const forget = $("forget-key");
  forget.hidden = !apiKey();
  forget.addEventListener("click", () => {
    setApiKey(null);
    forget.hidden = true;
  });
  onKeyNeeded((message) => {
    if (pending === null) {
      pending = new Promise((resolve) => {
        $("key-message").textContent = message;
        $("key-dialog").hidden = false;
        $("key-input").value = "";
        $("key-input").focus();
        $("key-form").onsubmit = (event) => {
          event.preventDefault();
          const key = $("key-input").value.trim();
          if (!key) return;
          setApiKey(key);
          forget.hidden = false;
          $("key-dialog").hidden = true;
          pending = null;
          resolve();
        };
      });
    }
    return pending;
  });
}

function showStatus(stats, error) {
  const status = $("server-status");
  if (error) {
    status.textContent = "not serving";
    status.dataset.state = "down";
    status.title = error;
    return;
  }
  const state = stats.server_status || "ready";
  status.textContent = `${stats.model} · ${state}`;
  status.dataset.state = state === "ready" ? "up" : "busy";
  status.title = `${stats.device}, attention ${stats.attention_backend}`;
}

function main() {
  setupTabs();
  setupKeyDialog();
  const settings = $("chat-settings");
  settings.open = window.matchMedia("(min-width: 800px)").matches;
  setupChat();
  setupEngineView(showStatus);
}

main();
