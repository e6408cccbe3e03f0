// The chat page: picks the model from /v1/models, streams /v1/chat/completions, keeps the
// conversations in local storage, and asks for an API key when the server answers 401. Images
// attached or pasted go with the next message as data: URLs.

import { Api, ApiError } from "./api.js";
import { AssistantView, button, editInPlace, element, errorNode, imageNode, statsText, userNode } from "./messages.js";
import { Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const api = new Api(() => store.apiKey);
const SETTING_FIELDS = { systemPrompt: "system-prompt", temperature: "temperature", topP: "top-p",
                         maxTokens: "max-tokens", tools: "tools" };
const MODELS_RETRY_MS = 5000;
const emptyHint = $("empty-hint");
let generation = null;  // { controller, view } while an answer streams
let afterKey = null;  // what to do once the API key is given
let modelsRetry = null;  // the next try at /v1/models while it fails
let randomModels = new Set();  // ids of the models whose weights are random (xserv's demo)
let attached = [];  // data: URLs of the images that go with the next message

function setStatus(text, isError = false) {
  $("server-status").textContent = text;
  $("server-status").classList.toggle("error", isError);
}

async function loadModels() {
  clearTimeout(modelsRetry);
  try {
    const cards = await api.models();
    const ids = cards.map((card) => card.id);
    randomModels = new Set(cards.filter((card) => card.random_weights).map((card) => card.id));
    $("model").replaceChildren(...ids.map((id) => new Option(id, id)));
    if (!ids.includes(store.settings.model)) store.settings.model = ids[0] ?? "";
    $("model").value = store.settings.model;
    showDemoCaveat();
    setStatus("");
  } catch (error) {
    if (error.status === 401) {
      setStatus("This server needs an API key.", true);
      askKey(error.message, loadModels);
    } else {
      setStatus(`Cannot list the models. ${error.readable ?? error.message}`, true);
      modelsRetry = setTimeout(loadModels, MODELS_RETRY_MS);  // the engine may still be starting
    }
  }
}

function showDemoCaveat() {
  $("demo-caveat").hidden = !randomModels.has(store.settings.model);
}

function askKey(reason, then) {
  $("key-reason").textContent = `This server needs an API key. It said: ${reason}`;
  afterKey = then;
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

function requestBody(conversation) {
  const settings = store.settings;
  const messages = settings.systemPrompt.trim() ? [{ role: "system", content: settings.systemPrompt }] : [];
  for (const message of conversation.messages) {
    if (message.role === "user") messages.push({ role: "user", content: userContent(message) });
    if (message.role === "assistant" && (message.content || message.toolCalls.length)) {
      const calls = message.toolCalls.filter((call) => isJson(call.arguments)).map(
        (call) => ({ id: call.id, type: "function", function: { name: call.name, arguments: call.arguments } }));
      messages.push({ role: "assistant", content: message.content, ...(calls.length ? { tool_calls: calls } : {}) });
    }
  }
  const body = { messages, stream: true, stream_options: { include_usage: true },
                 chat_template_kwargs: { enable_thinking: settings.thinking } };
  if (settings.model) body.model = settings.model;
  for (const [field, name] of [["temperature", "temperature"], ["topP", "top_p"], ["maxTokens", "max_tokens"]]) {
    if (String(settings[field]).trim() !== "") body[name] = Number(settings[field]);
  }
  if (settings.tools.trim()) {
    let tools;
    try {
      tools = JSON.parse(settings.tools);
    } catch (error) {
      throw new Error(`Settings: the tools are not JSON (${error.message}).`);
    }
    if (!Array.isArray(tools)) throw new Error("Settings: the tools must be a JSON list of tool definitions.");
    body.tools = tools;
  }
  return body;
}

// A user message's content: its text, or with images the images (as Qwen's examples put them)
// then the text, as OpenAI's parts.
function userContent(message) {
  if (!message.images?.length) return message.content;
  const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return message.content ? [...images, { type: "text", text: message.content }] : images;
}

function isJson(text) {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

function applyChunk(message, chunk) {
  if (chunk.usage) message.usage = chunk.usage;
  for (const choice of chunk.choices ?? []) {
    const delta = choice.delta ?? {};
    message.reasoning += delta.reasoning_content ?? "";
    message.content += delta.content ?? "";
    for (const call of delta.tool_calls ?? []) {
      const slot = (message.toolCalls[call.index ?? 0] ??= { id: "", name: "", arguments: "" });
      slot.id = call.id ?? slot.id;
      slot.name += call.function?.name ?? "";
      slot.arguments += call.function?.arguments ?? "";
    }
    message.finish = choice.finish_reason ?? message.finish;
  }
}

async function answer() {
  const conversation = store.ensureCurrent();
  let body;
  try {
    body = requestBody(conversation);
  } catch (error) {
    conversation.messages.push({ role: "error", content: error.message });
    store.save();
    return render();
  }
  const message = { role: "assistant", content: "", reasoning: "", toolCalls: [], streaming: true };
  conversation.messages.push(message);
  const view = new AssistantView(message);
  generation = { controller: new AbortController(), view };
  render();
  const started = performance.now();
  let first = null;
  try {
    for await (const chunk of api.chat(body, generation.controller.signal)) {
      applyChunk(message, chunk);
      if (first === null && (message.content || message.reasoning || message.toolCalls.length)) first = performance.now();
      if (message.thoughtSeconds == null && (message.content || message.toolCalls.length) && message.reasoning) {
        message.thoughtSeconds = ((performance.now() - started) / 1000).toFixed(1);
      }
      view.scheduleUpdate();
      followBottom();
    }
  } catch (error) {
    if (error.name === "AbortError") {
      message.stopped = true;
    } else {
      message.error = error instanceof ApiError ? error.readable : `The page failed: ${error.message}`;
      if (error.status === 401) askKey(error.message, () => retryAfterKey(conversation, message));
    }
  } finally {
    delete message.streaming;
    if (message.reasoning && message.thoughtSeconds == null) {
      message.thoughtSeconds = ((performance.now() - started) / 1000).toFixed(1);
    }
    message.stats = statsText(message.usage, started, first, performance.now(), message.finish);
    generation = null;
    store.save();
    render();
  }
}

function retryAfterKey(conversation, message) {
  conversation.messages.splice(conversation.messages.indexOf(message), 1);
  loadModels();
  answer();
}

function send(text) {
  if (generation || (!text.trim() && !attached.length)) return;
  store.ensureCurrent().messages.push({ role: "user", content: text, ...(attached.length ? { images: attached } : {}) });
  $("input").value = "";
  attached = [];
  renderAttachments();
  store.save();
  answer();
}

function render() {
  const conversation = store.current;
  const messages = conversation?.messages ?? [];
  const lastUser = messages.map((m) => m.role).lastIndexOf("user");
  const nodes = messages.map((message, index) => {
    if (message.role === "user") {
      const onEdit = index === lastUser && !generation ? (node) => editLast(node, conversation, index) : null;
      return userNode(message, onEdit);
    }
    if (message.role === "error") return errorNode(message);
    return generation?.view.message === message ? generation.view.node : new AssistantView(message).node;
  });
  $("messages").replaceChildren(...(nodes.length ? nodes : [emptyHint]));
  $("send").hidden = Boolean(generation);
  $("stop").hidden = !generation;
  renderSidebar();
  followBottom(true);
}

function editLast(node, conversation, index) {
  editInPlace(node, conversation.messages[index], (text) => {
    conversation.messages[index].content = text;
    conversation.messages.splice(index + 1);
    store.save();
    answer();
  }, render);
}

// Reads image files (from the picker or the clipboard) as data: URLs for the next message.
async function attach(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  const urls = await Promise.all(images.map((file) => new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  })));
  attached.push(...urls);
  renderAttachments();
}

function renderAttachments() {
  $("attachments").replaceChildren(...attached.map((url, index) => {
    const remove = button("×", () => { attached.splice(index, 1); renderAttachments(); }, "remove");
    remove.title = "Remove this image";
    return element("figure", "attachment", imageNode(url, `image ${index + 1} to send`), remove);
  }));
  $("attachments").hidden = !attached.length;
}

function renderSidebar() {
  $("conversations").replaceChildren(...store.conversations.map((conversation) => {
    const open = button(conversation.title, () => switchTo(conversation.id), "open");
    const remove = button("×", () => {
      if (generation) return;
      store.remove(conversation.id);
      render();
    }, "delete");
    remove.title = "Delete this conversation";
    return element("li", conversation.id === store.currentId ? "current" : "", open, remove);
  }));
}

function switchTo(id) {
  if (generation) return;
  store.select(id);
  render();
}

function followBottom(force = false) {
  const box = $("messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

function bindControls() {
  for (const [name, id] of Object.entries(SETTING_FIELDS)) {
    $(id).value = store.settings[name];
    $(id).addEventListener("input", () => { store.settings[name] = $(id).value; store.saveSettings(); });
  }
  $("thinking").checked = store.settings.thinking;
  $("thinking").addEventListener("change", () => { store.settings.thinking = $("thinking").checked; store.saveSettings(); });
  $("model").addEventListener("change", () => {
    store.settings.model = $("model").value;
    store.saveSettings();
    showDemoCaveat();
  });
  $("settings-toggle").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!$("settings").hidden));
  });
  $("forget-key").addEventListener("click", () => { store.apiKey = ""; loadModels(); });
  $("new-chat").addEventListener("click", () => {
    if (generation) return;
    if (store.current?.messages.length !== 0) store.select(store.create().id);
    render();
    $("input").focus();
  });
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send($("input").value); });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send($("input").value);
    }
  });
  $("stop").addEventListener("click", () => generation?.controller.abort());
  $("attach").addEventListener("change", () => { attach($("attach").files); $("attach").value = ""; });
  $("input").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files ?? [])];
    if (!files.some((file) => file.type.startsWith("image/"))) return;  // text pastes as usual
    event.preventDefault();
    attach(files);
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    store.apiKey = $("key-input").value.trim();
    $("key-input").value = "";
    $("key-dialog").close();
    const then = afterKey;
    afterKey = null;
    then?.();
  });
  $("key-cancel").addEventListener("click", () => { afterKey = null; $("key-dialog").close(); });
}

bindControls();
render();
loadModels();
