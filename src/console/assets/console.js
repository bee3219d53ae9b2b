// outbox-relay console: live updates of the page's #live region (polling the page's own
// URL, pausable, paused while the operator is selecting or typing in it), and the "select
// all" box of the dead-letter list. No inline script anywhere: the CSP forbids it.
"use strict";

(function () {
  const body = document.body;
  const every = Number(body.dataset.refresh || "0");
  const live = document.getElementById("live");
  const pause = document.getElementById("pause");
  const state = document.getElementById("live-state");
  const KEY = "outbox-console-paused";
  let paused = sessionStorage.getItem(KEY) === "1";

  function show() {
    if (!pause) return;
    pause.setAttribute("aria-pressed", paused ? "true" : "false");
    pause.textContent = paused ? "Resume live updates" : "Pause live updates";
    if (state) state.textContent = paused ? "paused" : "live";
  }

  // The operator is working in the region: a ticked box or a focused field would be lost.
  function busy() {
    if (!live) return true;
    if (live.contains(document.activeElement) && document.activeElement !== live) return true;
    return live.querySelector("input[type=checkbox]:checked") !== null;
  }

  async function refresh() {
    if (paused || busy() || document.hidden) return;
    try {
      const response = await fetch(window.location.href, {
        headers: { "X-Console-Refresh": "1" },
        credentials: "same-origin",
      });
      if (!response.ok) {
        if (state) state.textContent = "update failed (" + response.status + ")";
        return;
      }
      const text = await response.text();
      const fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
      if (fresh && !busy()) {
        live.replaceChildren(...Array.from(fresh.childNodes).map((n) => document.importNode(n, true)));
        bindSelectAll();
        if (state) state.textContent = "live, updated " + new Date().toLocaleTimeString();
      }
    } catch (e) {
      if (state) state.textContent = "update failed: " + e.message;
    }
  }

  function bindSelectAll() {
    for (const all of document.querySelectorAll("input[data-select-all]")) {
      all.addEventListener("change", () => {
        const form = all.form;
        for (const box of form.querySelectorAll("input[type=checkbox][name=id]")) {
          box.checked = all.checked;
        }
      });
    }
  }

  if (pause) {
    pause.addEventListener("click", () => {
      paused = !paused;
      sessionStorage.setItem(KEY, paused ? "1" : "0");
      show();
    });
  }
  show();
  bindSelectAll();
  if (every > 0 && live) {
    window.setInterval(refresh, every);
  }
})();
