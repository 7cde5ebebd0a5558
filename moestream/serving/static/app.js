// moestream chat page: conversations in localStorage, answers streamed from /v1/chat/completions.
"use strict";

const KEY_STORE = "moestream.apiKey";
const CONV_STORE = "moestream.conversations";
const CURRENT_STORE = "moestream.current";
const SETTINGS_STORE = "moestream.settings";
const $ = (id) => document.getElementById(id);

// ---- the API key: asked once when the server answers 401, kept in localStorage, sent as Bearer ----------------
function authHeaders() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

let keyPromise = null;
function askKey() {
  if (keyPromise) return keyPromise;
  keyPromise = new Promise((resolve) => {
    const dlg = $("key-dialog");
    dlg.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (key) localStorage.setItem(KEY_STORE, key);
      keyPromise = null;
      resolve(Boolean(key));
    }, { once: true });
    dlg.showModal();
  });
  return keyPromise;
}

// fetch with the key; a 401 asks for the key and tries once more
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const res = await fetch(path, { ...options, headers: { ...(options.headers || {}), ...authHeaders() } });
    if (res.status !== 401 || attempt > 0 || !(await askKey())) return res;
  }
}

// server-sent events from a fetch response: calls onEvent(name, data) for each event
async function readSSE(res, onEvent, signal) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  while (!signal || !signal.aborted) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

window.moestream = { api, readSSE };

// ---- minimal Markdown: HTML escaped first, then code blocks, inline code, bold, italics, lists ------------------
function escapeHTML(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(s) {
  const parts = s.split(/(`[^`\n]+`)/);
  return parts.map((p, i) => i % 2 ? "<code>" + p.slice(1, -1) + "</code>" :
    p.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/(^|[^*\w])\*([^*\n]+)\*/g, "$1<em>$2</em>")
     .replace(/(^|\W)_([^_\n]+)_(?=\W|$)/g, "$1<em>$2</em>")).join("");
}

function markdown(text) {
  const out = [];
  const blocks = escapeHTML(text).split(/^```[^\n]*\n?/m);
  blocks.forEach((block, i) => {
    if (i % 2) { out.push("<pre><code>" + block.replace(/\n$/, "") + "</code></pre>"); return; }
    let list = null;
    for (const para of block.split(/\n{2,}/)) {
      for (const line of para.split("\n")) {
        const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
        if (item) {
          const tag = /\d/.test(item[1]) ? "ol" : "ul";
          if (list !== tag) { if (list) out.push(`</${list}>`); out.push(`<${tag}>`); list = tag; }
          out.push("<li>" + inline(item[2]) + "</li>");
        } else {
          if (list) { out.push(`</${list}>`); list = null; }
          if (line.trim()) out.push(inline(line) + "<br>");
        }
      }
      if (list) { out.push(`</${list}>`); list = null; }
      out.push("<p></p>");
    }
  });
  return out.join("");
}

// ---- conversations --------------------------------------------------------------------------------------------
let conversations = JSON.parse(localStorage.getItem(CONV_STORE) || "[]");
for (const c of conversations) for (const m of c.messages) m.streaming = false; // a reload cut its stream
let current = localStorage.getItem(CURRENT_STORE);
let controller = null; // the answer being streamed

function save() {
  localStorage.setItem(CONV_STORE, JSON.stringify(conversations));
  localStorage.setItem(CURRENT_STORE, current || "");
}

function conversation() {
  let c = conversations.find((c) => c.id === current);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
    conversations.unshift(c);
    current = c.id;
  }
  return c;
}

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    if (c.id === current) li.className = "current";
    const title = button(c.title, "title", () => { current = c.id; save(); renderAll(); });
    title.title = c.title;
    const rename = button("✎", "small", () => {
      const name = prompt("Rename conversation", c.title);
      if (name && name.trim()) { c.title = name.trim(); save(); renderList(); }
    });
    rename.setAttribute("aria-label", "Rename " + c.title);
    const del = button("✕", "small", () => {
      if (!confirm(`Delete "${c.title}"?`)) return;
      conversations = conversations.filter((x) => x !== c);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save(); renderAll();
    });
    del.setAttribute("aria-label", "Delete " + c.title);
    li.append(title, rename, del);
    ul.append(li);
  }
}

function button(text, cls, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  if (cls) b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

function renderMessage(m, i, c) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  div.dataset.index = i;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role;
  div.append(role);
  if (m.reasoning) {
    const det = document.createElement("details");
    det.innerHTML = "<summary>Reasoning</summary>";
    const r = document.createElement("div");
    r.className = "reasoning";
    r.textContent = m.reasoning;
    det.append(r);
    div.append(det);
  }
  const body = document.createElement("div");
  body.className = "body";
  body.innerHTML = m.role === "user" ? escapeHTML(m.content).replace(/\n/g, "<br>") : markdown(m.content || "");
  div.append(body);
  if (m.tool_calls && m.tool_calls.length) {
    const t = document.createElement("div");
    t.className = "tools";
    t.textContent = m.tool_calls.map((tc) => `tool call: ${tc.function.name}(${tc.function.arguments})`).join("\n");
    div.append(t);
  }
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    div.append(e);
  }
  if (m.role === "assistant" && !m.streaming) {
    const meta = document.createElement("div");
    meta.className = "meta";
    const speed = document.createElement("span");
    speed.className = "speed";
    speed.textContent = speedText(m.stats);
    meta.append(button("Copy", "", () => navigator.clipboard.writeText(m.content || "")));
    if (i === c.messages.length - 1) meta.append(button("Regenerate", "", () => regenerate()));
    meta.append(speed);
    div.append(meta);
  }
  return div;
}

function speedText(s) {
  if (!s) return "";
  const parts = [];
  if (s.prompt_tps != null) parts.push(`prompt ${s.prompt_tokens} tok at ${s.prompt_tps.toFixed(1)} tok/s`);
  if (s.cached_tokens != null) parts.push(`${s.cached_tokens} cached`);
  if (s.decode_tps != null) parts.push(`decode ${s.completion_tokens} tok at ${s.decode_tps.toFixed(1)} tok/s`);
  if (s.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function renderMessages() {
  const c = conversation();
  const box = $("messages");
  box.replaceChildren(...c.messages.map((m, i) => renderMessage(m, i, c)));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderList(); renderMessages(); }

// ---- settings ---------------------------------------------------------------------------------------------
const SETTINGS = { system: "set-system", temperature: "set-temperature", top_p: "set-top-p", max_tokens: "set-max-tokens" };
function loadSettings() {
  const s = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
  for (const [k, id] of Object.entries(SETTINGS)) if (s[k] != null) $(id).value = s[k];
}
function settings() {
  const s = {};
  for (const [k, id] of Object.entries(SETTINGS)) s[k] = $(id).value;
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(s));
  return s;
}

// ---- sending and streaming --------------------------------------------------------------------------------------
async function send(text) {
  const c = conversation();
  if (c.messages.length === 0) c.title = text.slice(0, 40) || "New chat";
  c.messages.push({ role: "user", content: text });
  await answer(c);
}

async function regenerate() {
  const c = conversation();
  if (controller || !c.messages.length) return;
  if (c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  await answer(c);
}

function request(c) {
  const s = settings();
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of c.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (!m.error || m.content) messages.push({ role: "assistant", content: m.content || "" });
  }
  const body = { model: modelName || "default", messages, stream: true, stream_options: { include_usage: true } };
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
  return body;
}

async function answer(c) {
  const m = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true };
  const body = request(c);
  c.messages.push(m);
  save(); renderAll();
  controller = new AbortController();
  setBusy(true);
  const node = () => $("messages").lastElementChild;
  const sent = performance.now();
  let first = 0;
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${res.status}`);
    }
    await readSSE(res, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) { m.error = chunk.error.message; return; }
      for (const ch of chunk.choices || []) {
        const d = ch.delta || {};
        if (!first && (d.content || d.reasoning_content)) first = performance.now();
        if (d.content) m.content += d.content;
        if (d.reasoning_content) m.reasoning += d.reasoning_content;
        for (const tc of d.tool_calls || []) mergeToolCall(m.tool_calls, tc);
      }
      if (chunk.usage) m.stats = stats(chunk.usage, sent, first);
      node().replaceWith(renderMessage(m, c.messages.length - 1, c));
      $("messages").scrollTop = $("messages").scrollHeight;
    }, controller.signal);
  } catch (e) {
    if (e.name === "AbortError") m.stats = { ...(m.stats || {}), stopped: true };
    else m.error = String(e.message || e);
  } finally {
    m.streaming = false;
    controller = null;
    setBusy(false);
    save(); renderAll();
  }
}

function mergeToolCall(calls, tc) {
  const i = tc.index || 0;
  if (!calls[i]) calls[i] = { id: tc.id, type: "function", function: { name: "", arguments: "" } };
  const f = tc.function || {};
  if (f.name) calls[i].function.name += f.name;
  if (f.arguments) calls[i].function.arguments += f.arguments;
}

// speeds from the server's usage.timings where it sends them, else timed here
function stats(usage, sent, first) {
  const t = usage.timings;
  const now = performance.now();
  const details = usage.prompt_tokens_details || {};
  const s = { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens, cached_tokens: details.cached_tokens };
  if (t) {
    s.prompt_tps = t.prompt_ms > 0 ? t.prompt_n / (t.prompt_ms / 1000) : null;
    s.decode_tps = t.predicted_ms > 0 ? t.predicted_n / (t.predicted_ms / 1000) : null;
  } else if (first) {
    s.prompt_tps = (usage.prompt_tokens - (details.cached_tokens || 0)) / ((first - sent) / 1000);
    s.decode_tps = now > first ? (usage.completion_tokens - 1) / ((now - first) / 1000) : null;
  }
  return s;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- tabs, keys, start ----------------------------------------------------------------------------------------
let modelName = "";

function showTab(name, push) {
  for (const t of ["chat", "engine"]) {
    $("tab-" + t).setAttribute("aria-selected", String(t === name));
    $("tab-" + t).tabIndex = t === name ? 0 : -1;
    $("view-" + t).hidden = t !== name;
  }
  if (push) history.replaceState(null, "", name === "engine" ? "/engine" : "/");
  document.dispatchEvent(new CustomEvent("moestream-tab", { detail: name }));
}

document.addEventListener("DOMContentLoaded", async () => {
  loadSettings();
  $("tab-chat").addEventListener("click", () => showTab("chat", true));
  $("tab-engine").addEventListener("click", () => showTab("engine", true));
  document.querySelector("nav").addEventListener("keydown", (e) => {
    if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
      const next = $("tab-chat").getAttribute("aria-selected") === "true" ? "engine" : "chat";
      showTab(next, true);
      $("tab-" + next).focus();
    }
  });
  $("new-chat").addEventListener("click", () => { current = null; conversation(); save(); renderAll(); $("input").focus(); });
  $("forget-key").addEventListener("click", () => localStorage.removeItem(KEY_STORE));
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) controller.abort();
    if (e.altKey && e.key === "n") { e.preventDefault(); $("new-chat").click(); }
  });
  showTab(location.pathname === "/engine" ? "engine" : "chat", false);
  renderAll();
  try {
    const res = await api("/v1/models");
    if (res.ok) { modelName = (await res.json()).data[0].id; $("model-name").textContent = modelName; }
  } catch (e) { /* the server is gone: sending will say so */ }
});
