// The JSON API client: every /api/v1 request carries the Bearer token kept in localStorage (no
// cookies, so writes are not open to CSRF). Errors become ApiError with the field the server named.

const TOKEN_KEY = "vla-rl-dashboard-token";
export const API = "/api/v1";

export function getToken() {
  return localStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token.trim());
  else localStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, detail, path) {
    const d = normaliseDetail(detail);
    super(d.message);
    this.status = status;
    this.field = d.field;
    this.expected = d.expected;
    this.path = path;
  }

  /** "field: message (expected ...)" as shown in the page. */
  get text() {
    const named = this.field && (this.message.startsWith(`${this.field}:`) || this.message.startsWith(`${this.field} `));
    let s = this.field && !named ? `${this.field}: ${this.message}` : this.message;
    if (this.expected && !this.message.includes(this.expected)) s += ` (expected ${this.expected})`;
    return s;
  }
}

function normaliseDetail(detail) {
  if (detail == null) return { message: "request failed" };
  if (typeof detail === "string") return { message: detail };
  if (Array.isArray(detail)) {
    // FastAPI's own validation errors: [{loc, msg, type}]
    const first = detail[0] || {};
    const loc = (first.loc || []).filter((x) => x !== "body" && x !== "query" && x !== "path");
    return { field: loc.join("."), message: detail.map((d) => d.msg).join("; ") || "invalid request" };
  }
  return {
    field: detail.field || "",
    message: detail.message || detail.msg || JSON.stringify(detail),
    expected: detail.expected || "",
  };
}

function headers(extra = {}) {
  const h = { ...extra };
  const t = getToken();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

async function failure(res, path) {
  let detail = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    detail = body.detail ?? body;
  } catch {
    /* not JSON */
  }
  const err = new ApiError(res.status, detail, path);
  if (res.status === 401) window.dispatchEvent(new CustomEvent("vla:unauthorized", { detail: err }));
  return err;
}

/** The response promise of a request index.html started before the modules loaded (once). */
function takeEarly(path) {
  const early = window.vlaEarly;
  if (!early || !(path in early)) return null;
  const p = early[path];
  delete early[path];
  return p;
}

/** JSON request to /api/v1{path}; `body` is sent as JSON. Throws ApiError. */
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(), signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = (method === "GET" && takeEarly(path)) || (await fetch(API + path, init));
    res = await res;
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, { message: `dashboard server unreachable (${e.message})` }, path);
  }
  if (!res.ok) throw await failure(res, path);
  if (res.status === 204) return null;
  return res.json();
}

/** A binary resource (a JPEG frame) as a Blob, with the auth header. */
export async function blob(path, { signal } = {}) {
  const res = await fetch(API + path, { headers: headers(), signal });
  if (!res.ok) throw await failure(res, path);
  return res.blob();
}

/**
 * Server-Sent Events over fetch streaming (EventSource cannot send the Authorization header).
 * Calls onEvent(name, data) for each event (data JSON-parsed when it is JSON); resolves when the
 * stream ends or `signal` aborts.
 */
export async function sse(path, onEvent, { signal } = {}) {
  const res = await fetch(API + path, { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!res.ok) throw await failure(res, path);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let idx;
      while ((idx = buf.search(/\r?\n\r?\n/)) >= 0) {
        const raw = buf.slice(0, idx);
        buf = buf.slice(idx).replace(/^\r?\n\r?\n/, "");
        let name = "message";
        const data = [];
        for (const line of raw.split(/\r?\n/)) {
          if (line.startsWith(":")) continue;
          const [k, ...rest] = line.split(":");
          const v = rest.join(":").replace(/^ /, "");
          if (k === "event") name = v;
          else if (k === "data") data.push(v);
        }
        if (!data.length && name === "message") continue;
        const text = data.join("\n");
        let parsed = text;
        try {
          parsed = JSON.parse(text);
        } catch {
          /* plain text */
        }
        if (onEvent(name, parsed) === false) return;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") throw e;
  }
}

/** URLSearchParams -> "?a=1&b=2" without empty values. */
export function queryString(params) {
  const q = new URLSearchParams();
  for (const [k, v] of params instanceof URLSearchParams ? params.entries() : Object.entries(params)) {
    if (v === undefined || v === null || v === "") continue;
    if (Array.isArray(v)) v.forEach((x) => q.append(k, x));
    else q.append(k, v);
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}
