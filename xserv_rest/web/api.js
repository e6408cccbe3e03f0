// The page's side of the OpenAI REST API on this server: the model list, and a chat completion
// streamed as server-sent events. Errors become ApiError with a message a person can act on.

// An error event in a stream carries no HTTP status: its type tells it.
const STATUS_OF_TYPE = { invalid_request_error: 400, rate_limit_error: 429, service_unavailable: 503, timeout: 504 };

const STATUS_NAMES = { 400: "Bad request", 401: "Unauthorized", 404: "Not found", 413: "Request too large",
                       429: "Busy, try again", 500: "Server error", 503: "Service unavailable", 504: "Timed out" };

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;  // HTTP status; 0 when the server could not be reached
  }

  // "Service unavailable (503): the engine is unavailable (starting, draining or down); retry later"
  get readable() {
    if (this.status === 0) return this.message;
    const name = STATUS_NAMES[this.status] ?? (this.status >= 500 ? "Server error" : "Request refused");
    return `${name} (${this.status}): ${this.message}`;
  }
}

export class Api {
  constructor(getKey) {
    this.getKey = getKey;  // () => the API key, or ""
  }

  // The model cards: { id, random_weights (xserv's demo model), ... }
  async models() {
    const response = await this.request("/v1/models", {});
    return (await response.json()).data;
  }

  // Yields each chunk of a streamed chat completion; aborting `signal` closes the connection,
  // which makes the server cancel the request and the engine free it.
  async *chat(body, signal) {
    const response = await this.request("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal, headers: { "Content-Type": "application/json" },
    });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new ApiError(0, "The server closed the stream before the answer was finished.");
      buffered += value;
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const data = dataOf(buffered.slice(0, end));
        buffered = buffered.slice(end + 2);
        if (data === "[DONE]") return;
        if (data === null) continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(STATUS_OF_TYPE[chunk.error.type] ?? 500, chunk.error.message);
        yield chunk;
      }
    }
  }

  async request(path, options) {
    const headers = { ...options.headers };
    const key = this.getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    let response;
    try {
      response = await fetch(path, { ...options, headers });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(0, `Cannot reach the xserv server at ${location.origin}: is it still running?`);
    }
    if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
    return response;
  }
}

function dataOf(event) {
  const lines = event.split("\n").filter((line) => line.startsWith("data:"));
  return lines.length ? lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n") : null;
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return text.trim().slice(0, 300) || response.statusText || "no details";
  }
}
