// History-API router: path patterns -> page modules. A page's render(root, ctx) may return a
// cleanup function, called before the next page renders (stops timers, streams, key handlers).

const routes = [];
let current = null; // {cleanup, path}
let rootEl = null;
let contextFn = () => ({});

/** route("/episodes/:id", loader) where loader() resolves to a module with render(root, ctx). */
export function route(pattern, loader) {
  const names = [];
  const re = new RegExp(
    "^" +
      pattern.replace(/\/:([a-z]+)/g, (_, n) => {
        names.push(n);
        return "/([^/]+)";
      }) +
      "/?$",
  );
  routes.push({ re, names, loader, pattern });
}

export function start(root, ctx) {
  rootEl = root;
  contextFn = ctx;
  window.addEventListener("popstate", () => render());
  document.addEventListener("click", (ev) => {
    const a = ev.target.closest && ev.target.closest("a[href]");
    if (!a || ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey) return;
    const url = new URL(a.href, location.href);
    if (url.origin !== location.origin || url.pathname.startsWith("/api/") || a.target) return;
    if (url.pathname.startsWith("/static/")) return;
    ev.preventDefault();
    navigate(url.pathname + url.search);
  });
  return render();
}

/** Go to `url` (path + query); pushes a history entry unless replace. */
export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  return render();
}

/** Change the query of the current page without re-rendering it (filters, ?t=). */
export function setQuery(params, { replace = true } = {}) {
  const q = params.toString();
  const url = location.pathname + (q ? `?${q}` : "");
  if (url === location.pathname + location.search) return;
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
}

export async function render() {
  if (current && current.cleanup) {
    try {
      current.cleanup();
    } catch (e) {
      console.error(e);
    }
  }
  current = null;
  const path = location.pathname;
  for (const r of routes) {
    const m = r.re.exec(path);
    if (!m) continue;
    const params = {};
    r.names.forEach((n, i) => (params[n] = decodeURIComponent(m[i + 1])));
    const mod = await r.loader();
    const state = { path };
    current = state;
    document.querySelectorAll("nav a[data-nav]").forEach((a) => {
      a.classList.toggle("active", path === a.getAttribute("href") || (a.getAttribute("href") !== "/" && path.startsWith(a.getAttribute("href"))));
    });
    rootEl.replaceChildren();
    // the page sees the app's live context (session and schema may still be loading: await ctx.ready)
    const ctx = Object.assign(Object.create(contextFn()), { params, query: new URLSearchParams(location.search) });
    const cleanup = await mod.render(rootEl, ctx);
    if (current === state) state.cleanup = cleanup;
    else if (cleanup) cleanup();
    return;
  }
  rootEl.replaceChildren();
  rootEl.append(Object.assign(document.createElement("p"), { className: "error", textContent: `no page at ${path}` }));
}
