// attnserve playground: chat (streamed through /v1/chat/completions) and zh<->en translation
// (/v1/translate). Plain browser JavaScript, no build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const CHAT_MODEL = "smollm2-135m-instruct";
const MAX_TEXTS_PER_CALL = 32; // the service's default ApiLimits.max_texts

// ---- API key (only when the service has ATTNSERVE_API_KEYS set) ---------------------------------

function apiHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem("attnserve-api-key", key);
  else localStorage.removeItem("attnserve-api-key");
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// ---- errors ------------------------------------------------------------------------------------

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// A readable message from a failed response: {"error": {"message"}} or FastAPI's {"detail"}.
async function apiError(resp) {
  let message = "";
  try {
    const body = await resp.json();
    if (body && body.error) message = body.error.message || JSON.stringify(body.error);
    else if (body && body.detail) message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (_) {
    message = resp.statusText;
  }
  let text = `Error ${resp.status}: ${message || "request failed"}`;
  if (resp.status === 429) {
    const retry = resp.headers.get("Retry-After");
    text += ` — the service is busy${retry ? `, retry in ${retry} s` : ""}.`;
  }
  return text;
}

function networkError(err) {
  return `Cannot reach the service (${err.message || err}). Is it still running?`;
}

// ---- tabs --------------------------------------------------------------------------------------

function selectTab(name) {
  for (const tab of ["chat", "translate"]) {
    const on = tab === name;
    $(`tab-${tab}`).setAttribute("aria-selected", String(on));
    $(`panel-${tab}`).hidden = !on;
  }
  showError("");
}

// ---- server-sent events ------------------------------------------------------------------------

// Calls onEvent(parsedJson) for every `data:` event of a fetch response body; returns at [DONE] or EOF.
async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

// ---- chat --------------------------------------------------------------------------------------

const chat = { history: [], controller: null };

function addMessage(role, text) {
  const hint = document.querySelector("#chat-log .hint");
  if (hint) hint.remove();
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

function numberInput(id, min, max, name) {
  const v = Number($(id).value);
  if (!Number.isFinite(v) || v < min || v > max) throw new Error(`${name} must be between ${min} and ${max}`);
  return v;
}

function setBusy(busy) {
  $("chat-send").disabled = busy;
  $("chat-stop").disabled = !busy;
}

async function sendChat(event) {
  if (event) event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || chat.controller) return;
  let body;
  try {
    body = {  // no model: the service's generator, whatever its configured name
      messages: [...chat.history, { role: "user", content: text }],
      temperature: numberInput("temperature", 0, 2, "temperature"),
      top_p: numberInput("top-p", 0.01, 1, "top-p"),
      max_tokens: Math.round(numberInput("max-tokens", 1, 8192, "max tokens")),
      stream: true,
      stream_options: { include_usage: true },
    };
  } catch (err) {
    showError(err.message);
    return;
  }
  showError("");
  $("chat-input").value = "";
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.classList.add("streaming");
  chat.controller = new AbortController();
  setBusy(true);

  const t0 = performance.now();
  let tFirst = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  let answer = "";
  let stopped = false;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!resp.ok) throw new Error(await apiError(resp));
    await readSSE(resp, (ev) => {
      if (ev.error) throw new Error(`Error during generation: ${ev.error.message || JSON.stringify(ev.error)}`);
      if (ev.usage) usage = ev.usage;
      const choice = (ev.choices || [])[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = (choice.delta && choice.delta.content) || "";
      if (!delta) return;
      if (tFirst === null) tFirst = performance.now();
      chunks += 1;
      answer += delta;
      out.textContent = answer;
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
    });
  } catch (err) {
    if (err.name === "AbortError") {
      stopped = true;
    } else {
      showError(err instanceof TypeError ? networkError(err) : err.message);
    }
  } finally {
    const tEnd = performance.now();
    out.classList.remove("streaming");
    chat.controller = null;
    setBusy(false);
    if (stopped) {
      const note = document.createElement("span");
      note.className = "note";
      note.textContent = answer ? " [stopped]" : "[stopped before the first token]";
      out.appendChild(note);
    }
    if (answer) {
      chat.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    } else if (!stopped) {
      out.remove();
    }
    const line = showStats(t0, tFirst, tEnd, usage, usage ? usage.completion_tokens : chunks,
                           finish || (stopped ? "stopped" : null));
    if (line && out.isConnected) {
      const stats = document.createElement("div");
      stats.className = "msg-stats";
      stats.textContent = line;
      Object.assign(stats.dataset, $("chat-stats").dataset);
      out.after(stats);
    }
  }
}

// The figures of one answer: time to first token, decode rate, tokens used (the service's usage when
// it sent one). Returns the line shown, or null when no token came.
function showStats(t0, tFirst, tEnd, usage, tokens, finish) {
  if (tFirst === null) {
    $("chat-stats").textContent = "No tokens received.";
    return null;
  }
  const ttft = tFirst - t0;
  const rate = tokens > 1 && tEnd > tFirst ? ((tokens - 1) * 1000) / (tEnd - tFirst) : null;
  const parts = [`TTFT ${ttft.toFixed(0)} ms`];
  if (rate !== null) parts.push(`${rate.toFixed(1)} tok/s`);
  parts.push(usage ? `${usage.prompt_tokens} + ${usage.completion_tokens} = ${usage.total_tokens} tokens`
                   : `${tokens} tokens`);
  if (finish) parts.push(`finish: ${finish}`);
  const line = parts.join(" · ");
  $("chat-stats").textContent = "Last answer: " + line;
  const data = $("chat-stats").dataset;
  data.ttftMs = ttft.toFixed(1);
  data.tokens = String(tokens);
  data.tokPerS = rate === null ? "" : rate.toFixed(2);
  data.promptTokens = usage ? String(usage.prompt_tokens) : "";
  data.totalTokens = usage ? String(usage.total_tokens) : "";
  return line;
}

// ---- live engine panel: running / waiting requests and KV cache use, read from /metrics ----------

const ENGINE_REFRESH_MS = 3000;

function gauge(text, name, model) {
  const m = text.match(new RegExp(`^attnserve_${name}\\{model="${model}"\\} (\\S+)$`, "m"));
  return m ? Number(m[1]) : null;
}

async function refreshEngine() {
  const panel = $("engine-panel");
  let text;
  try {
    const resp = await fetch("/metrics");
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    text = await resp.text();
  } catch (err) {
    panel.textContent = `Engine figures unavailable (${err.message || err}).`;
    return;
  }
  const rows = [];
  for (const model of engine.models) {
    const running = gauge(text, "num_requests_running", model);
    const waiting = gauge(text, "num_requests_waiting", model);
    const kv = gauge(text, "kv_cache_usage_ratio", model);
    if (running === null && waiting === null && kv === null) continue;
    rows.push({ model, running: running ?? 0, waiting: waiting ?? 0, kv: kv ?? 0 });
  }
  panel.replaceChildren(...rows.map((r) => {
    const el = document.createElement("div");
    el.className = "engine-row";
    Object.assign(el.dataset, { model: r.model, running: String(r.running), waiting: String(r.waiting),
                                kv: String(r.kv) });
    el.textContent = `${r.model}: ${r.running} running · ${r.waiting} waiting · KV cache ${(100 * r.kv).toFixed(1)} %`;
    return el;
  }));
  if (!rows.length) panel.textContent = "No engine figures yet.";
  panel.dataset.updated = String(Date.now());
}

const engine = { models: [CHAT_MODEL, "attnserve-zh-en"] };

function stopChat() {
  if (chat.controller) chat.controller.abort();
}

function clearChat() {
  stopChat();
  chat.history = [];
  $("chat-log").innerHTML = "";
  $("chat-stats").textContent = "No answer yet.";
  showError("");
}

// ---- translate ---------------------------------------------------------------------------------

async function translate() {
  const lines = $("tr-input").value.split("\n");
  const todo = lines.map((l, i) => [i, l.trim()]).filter(([, l]) => l);
  if (!todo.length) {
    showError("Type one or more sentences to translate, one per line.");
    return;
  }
  let beam;
  try {
    beam = Math.round(numberInput("tr-beam", 1, 8, "beam size"));
  } catch (err) {
    showError(err.message);
    return;
  }
  const dir = $("tr-direction").value;
  const extra = dir === "auto" ? {} : { source_lang: dir.slice(0, 2), target_lang: dir.slice(3) };
  showError("");
  $("tr-go").disabled = true;
  $("tr-copy").disabled = true;
  $("tr-output").textContent = "Translating…";
  const out = lines.map(() => "");
  const t0 = performance.now();
  try {
    for (let k = 0; k < todo.length; k += MAX_TEXTS_PER_CALL) {
      const part = todo.slice(k, k + MAX_TEXTS_PER_CALL);
      const resp = await fetch("/v1/translate", {
        method: "POST",
        headers: apiHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify({ text: part.map(([, l]) => l), beam_size: beam, ...extra }),
      });
      if (!resp.ok) throw new Error(await apiError(resp));
      const body = await resp.json();
      part.forEach(([i], j) => (out[i] = body.translations[j]));
    }
    $("tr-output").textContent = out.join("\n");
    $("tr-copy").disabled = false;
    const secs = (performance.now() - t0) / 1000;
    $("tr-stats").textContent = `${todo.length} line(s) in ${secs.toFixed(2)} s, beam ${beam}`;
  } catch (err) {
    $("tr-output").textContent = "";
    showError(err instanceof TypeError ? networkError(err) : err.message);
  } finally {
    $("tr-go").disabled = false;
  }
}

async function copyTranslation() {
  const text = $("tr-output").textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {
    // Clipboard API needs a secure context; 127.0.0.1 is one, but fall back to a selection copy anyway.
    const range = document.createRange();
    range.selectNodeContents($("tr-output"));
    const sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
    document.execCommand("copy");
    sel.removeAllRanges();
  }
  $("tr-copy").textContent = "Copied";
  setTimeout(() => ($("tr-copy").textContent = "Copy"), 1200);
}

// ---- start -------------------------------------------------------------------------------------

async function loadModels() {
  try {
    const resp = await fetch("/v1/models", { headers: apiHeaders() });
    if (!resp.ok) throw new Error(await apiError(resp));
    const ids = (await resp.json()).data.map((m) => m.id);
    if (ids.length) engine.models = ids;
    $("models").textContent = ids.length ? `models: ${ids.join(", ")}` : "no models loaded";
  } catch (err) {
    $("models").textContent = "models: unknown";
  }
}

$("api-key").value = localStorage.getItem("attnserve-api-key") || "";
$("api-key").addEventListener("change", loadModels);
$("tab-chat").addEventListener("click", () => selectTab("chat"));
$("tab-translate").addEventListener("click", () => selectTab("translate"));
$("chat-form").addEventListener("submit", sendChat);
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) sendChat(e);
});
$("chat-stop").addEventListener("click", stopChat);
$("chat-clear").addEventListener("click", clearChat);
$("tr-go").addEventListener("click", translate);
$("tr-copy").addEventListener("click", copyTranslation);
loadModels().then(refreshEngine);
setInterval(refreshEngine, ENGINE_REFRESH_MS);
