// Small DOM and formatting helpers shared by the pages.

/** h("div.cls#id", {attrs, onclick}, ...children): build an element. */
export function h(spec, attrs = {}, ...children) {
  // null (an optional child left out) is a child too: typeof null is "object"
  if (attrs === null || attrs instanceof Node || typeof attrs !== "object" || Array.isArray(attrs)) {
    children.unshift(attrs);
    attrs = {};
  }
  const [tagPart, ...rest] = spec.split(".");
  const [tag, id] = tagPart.split("#");
  const svg = ["svg", "rect", "line", "g", "title", "path", "text", "polyline"].includes(tag);
  const el = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag || "div");
  if (id) el.id = id;
  if (rest.length) el.setAttribute("class", rest.join(" "));
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style" && typeof v === "object") Object.assign(el.style, v);
    else if (k === "value" && !svg) el.value = v;
    else if (k === "checked" || k === "selected" || k === "disabled") el[k] = Boolean(v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export const pct = (x) => (x === null || x === undefined || Number.isNaN(x) ? "–" : `${(100 * x).toFixed(0)}%`);
export const num = (x, d = 0) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
export const short = (rev) => (rev ? String(rev).slice(0, 8) : "–");
/** An integer with thousands separators (10,000) without Intl: a page's first toLocaleString() loads
 * the locale's number data, 8-35 ms on the Episodes page's first load. */
export const thousands = (n) => String(Math.trunc(n)).replace(/\B(?=(\d{3})+(?!\d))/g, ",");

export function when(t) {
  if (t === null || t === undefined) return "–";
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  if (Number.isNaN(d.getTime())) return String(t);
  return d.toISOString().replace("T", " ").slice(0, 19);
}

export function ago(t) {
  if (!t) return "–";
  const s = Date.now() / 1000 - (typeof t === "number" ? t : new Date(t).getTime() / 1000);
  if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

/** An error box for a failed API call (the message names the field). */
export function errorBox(err, what = "") {
  const text = err && err.text ? err.text : String(err && err.message ? err.message : err);
  return h("div.error", { role: "alert" }, what ? `${what}: ${text}` : text);
}

/** Show `err` in `slot` (replacing what is there), or clear it when err is null. */
export function showError(slot, err, what = "") {
  clear(slot, err ? errorBox(err, what) : null);
}

/** A confirmation dialog; resolves true when confirmed (Enter on the confirm button, Esc cancels). */
export function confirmDialog(title, body, confirmLabel = "Confirm") {
  return new Promise((resolve) => {
    const ok = h("button.danger", { type: "submit", value: "ok" }, confirmLabel);
    const dlg = h(
      "dialog.confirm",
      h(
        "form",
        { method: "dialog" },
        h("h3", title),
        h("p", body),
        h("menu", h("button", { type: "submit", value: "cancel" }, "Cancel"), ok),
      ),
    );
    document.body.append(dlg);
    dlg.addEventListener("close", () => {
      resolve(dlg.returnValue === "ok");
      dlg.remove();
    });
    dlg.showModal();
    ok.focus();
  });
}

/** Is the keyboard focus in a text field (so page shortcuts must not fire)? */
export function typing(ev) {
  const t = ev.target;
  if (!t || !t.tagName) return false;
  return ["INPUT", "TEXTAREA", "SELECT"].includes(t.tagName) || t.isContentEditable;
}

export function debounce(fn, ms) {
  let timer;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

/** A stable colour per name (revision, robot...). */
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
export function colour(name, i) {
  if (i !== undefined) return PALETTE[i % PALETTE.length];
  let x = 0;
  for (const c of String(name)) x = (x * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[x % PALETTE.length];
}

export function badge(text, cls = "", title = "") {
  return h(`span.badge${cls ? "." + cls : ""}`, { title: title || undefined }, text);
}

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** Text (anything: null and undefined are "") escaped for HTML text and quoted attribute values. */
export function esc(x) {
  return x === null || x === undefined ? "" : String(x).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

/** badge() as an HTML string (every part escaped), for tables built as one string. */
export function badgeHtml(text, cls = "", title = "") {
  return `<span class="badge${cls ? " " + esc(cls) : ""}"${title ? ` title="${esc(title)}"` : ""}>${esc(text)}</span>`;
}
