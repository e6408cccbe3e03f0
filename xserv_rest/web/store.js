// What the page keeps in the browser's local storage: the conversations, the settings and the
// API key. Nothing of it goes to the server but the messages of the conversation being answered.

const CONVERSATIONS = "xserv.chat.conversations";
const CURRENT = "xserv.chat.current";
const SETTINGS = "xserv.chat.settings";
const KEY = "xserv.chat.apiKey";

export const DEFAULT_SETTINGS = {
  model: "", systemPrompt: "", temperature: "", topP: "", maxTokens: "", thinking: true, tools: "",
};

function read(name, fallback) {
  try {
    return JSON.parse(localStorage.getItem(name)) ?? fallback;
  } catch {
    return fallback;
  }
}

function withoutImages(message) {
  if (!message.images?.length) return message;
  const { images, ...rest } = message;
  return { ...rest, imagesNotKept: (message.imagesNotKept ?? 0) + images.length };
}

export class Store {
  constructor() {
    this.conversations = read(CONVERSATIONS, []);
    this.currentId = localStorage.getItem(CURRENT);
    this.settings = { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  // The conversation shown, made when there is none yet.
  ensureCurrent() {
    if (!this.current) this.select(this.create().id);
    return this.current;
  }

  create() {
    // Not crypto.randomUUID: a page opened by a LAN address over plain HTTP is no secure context.
    const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
    const conversation = { id, title: "New chat", messages: [], updated: Date.now() };
    this.conversations.unshift(conversation);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    localStorage.setItem(CURRENT, id ?? "");
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.select(this.conversations[0]?.id ?? null);
    this.persist();
  }

  // After the current conversation changed: its title and time, then everything to storage.
  save() {
    const current = this.current;
    if (current) {
      current.updated = Date.now();
      const first = current.messages.find((m) => m.role === "user");
      if (first) current.title = first.content.slice(0, 60) || "Image";
    }
    this.conversations.sort((a, b) => b.updated - a.updated);
    this.persist();
  }

  // Images make conversations large: past the browser's quota they are kept in this page only,
  // and the stored messages say how many were left out.
  persist() {
    try {
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
    } catch (error) {
      if (error.name !== "QuotaExceededError") throw error;
      localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations, (key, value) =>
        key === "messages" ? value.map(withoutImages) : value));
    }
  }

  saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
  }

  get apiKey() {
    return localStorage.getItem(KEY) ?? "";
  }

  set apiKey(key) {
    if (key) localStorage.setItem(KEY, key);
    else localStorage.removeItem(KEY);
  }
}
