// How a conversation's messages look. An assistant message keeps its nodes while it streams
// (the thinking block stays open or folded as the reader left it) and redraws at most every
// REDRAW_MS. All text goes in as text: renderMarkdown builds nodes, never HTML.

import { renderMarkdown } from "./markdown.js";

const REDRAW_MS = 40;

export function element(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

export function button(label, onClick, className = "") {
  const node = element("button", className, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

export class AssistantView {
  constructor(message) {
    this.message = message;
    this.summary = element("summary", "", "Thinking");
    this.reasoning = element("div", "reasoning-text");
    this.thinking = element("details", "thinking", this.summary, this.reasoning);
    this.content = element("div", "content markdown");
    this.toolCalls = element("div", "tool-calls");
    this.footer = element("div", "stats");
    this.node = element("article", "message assistant", this.thinking, this.content, this.toolCalls, this.footer);
    this.timer = null;
    this.update();
  }

  scheduleUpdate() {
    this.timer ??= setTimeout(() => {
      this.timer = null;
      this.update();
    }, REDRAW_MS);
  }

  update() {
    const { message } = this;
    this.thinking.hidden = !message.reasoning;
    this.reasoning.textContent = message.reasoning;
    this.summary.textContent = message.thoughtSeconds == null ? "Thinking…" : `Thought for ${message.thoughtSeconds} s`;
    this.content.replaceChildren(renderMarkdown(message.content));
    this.toolCalls.replaceChildren(...message.toolCalls.map(toolCallNode));
    this.footer.replaceChildren(...footerNodes(message));
  }
}

function toolCallNode(call) {
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(call.arguments), null, 2);
  } catch {
    // still streaming, or not JSON: shown as it came
  }
  const name = element("div", "tool-name", "Tool call ", element("code", "", call.name || "…"));
  return element("div", "tool-call", name, element("pre", "", element("code", "", args)));
}

function footerNodes(message) {
  const nodes = [];
  if (message.error) nodes.push(element("div", "error", message.error));
  if (message.stopped) nodes.push(element("span", "stopped", "Stopped."));
  if (message.stats) nodes.push(element("span", "numbers", message.stats));
  if (message.streaming && !message.content && !message.reasoning && !message.toolCalls.length) {
    nodes.push(element("span", "waiting", "Waiting for the first token…"));
  }
  return nodes;
}

// "12 tokens · 31.4 tokens/s · prompt 20 tokens · first token 0.21 s": decoding speed from the
// first token on, as llama.cpp's page shows it.
export function statsText(usage, startedMs, firstMs, endMs, finish) {
  const parts = [];
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    const seconds = (endMs - (firstMs ?? startedMs)) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0.05) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tokens/s`);
    }
    parts.push(`prompt ${usage.prompt_tokens} tokens`);
  }
  if (firstMs != null) parts.push(`first token ${((firstMs - startedMs) / 1000).toFixed(2)} s`);
  if (finish === "length") parts.push("stopped at the token limit");
  return parts.join(" · ");
}

export function imageNode(url, alt) {
  const image = element("img", "");
  image.src = url;  // a data: URL the person attached: the page's CSP allows only those and its own
  image.alt = alt;
  return image;
}

export function userNode(message, onEdit) {
  const node = element("article", "message user");
  if (message.images?.length) {
    node.append(element("div", "images", ...message.images.map((url, i) => imageNode(url, `attached image ${i + 1}`))));
  }
  if (message.imagesNotKept) {
    node.append(element("div", "not-kept", `${message.imagesNotKept} image(s) not kept: too large for this browser's storage`));
  }
  node.append(element("div", "text", message.content));
  if (onEdit) node.append(button("Edit", () => onEdit(node), "edit"));
  return node;
}

export function errorNode(message) {
  return element("article", "message error", element("div", "error", message.content));
}

// The last user message, in place: a text box with Send (which drops what came after it and
// asks again) and Cancel.
export function editInPlace(node, message, onSend, onCancel) {
  const editor = element("textarea", "editor");
  editor.value = message.content;
  editor.rows = Math.min(12, message.content.split("\n").length + 1);
  const send = button("Send", () => editor.value.trim() && onSend(editor.value), "send-edit");
  node.replaceChildren(editor, element("div", "edit-bar", send, button("Cancel", onCancel)));
  editor.focus();
}
