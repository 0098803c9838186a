// Entry point: session and label schema, the health banner, the token prompt, global keys, routes.
import { api, ApiError, getToken, setToken } from "./api.js";
import { navigate, render, route, start } from "./router.js";
import { typing } from "./util.js";

performance.mark("vla:app-start"); // the modules loaded and ran (bench/dashboard.py reads the marks)
const ROLES = ["viewer", "labeller", "operator"];
const ctx = { session: null, schema: null, ready: Promise.resolve(false), can };

/** Does the session's role reach `role`? */
export function can(role) {
  if (!ctx.session) return false;
  return ROLES.indexOf(ctx.session.role) >= ROLES.indexOf(role);
}

route("/", () => import("./pages/fleet.js"));
route("/fleet", () => import("./pages/fleet.js"));
route("/episodes", () => import("./pages/episodes.js"));
route("/episodes/:id", () => import("./pages/episode.js"));
route("/rounds", () => import("./pages/rounds.js"));
route("/rounds/:n", () => import("./pages/rounds.js"));
route("/help", () => import("./pages/help.js"));

const $ = (id) => document.getElementById(id);

function askToken(reason) {
  const dlg = $("token-dialog");
  $("token-reason").textContent = reason;
  if (!dlg.open) dlg.showModal();
  $("token-input").focus();
}

async function loadSession() {
  // both at once; the schema is only used once the session is known
  const schemaP = api("/label-schema").catch(() => ({ episode: [], span: [] }));
  try {
    ctx.session = await api("/session");
    $("session").textContent = `${ctx.session.name} (${ctx.session.role})`;
  } catch (e) {
    ctx.session = null;
    const rejected = e instanceof ApiError && e.status === 401;
    $("session").textContent = rejected ? "not signed in" : "";
    if (rejected) return false;
    throw e;
  }
  ctx.schema = await schemaP;
  return true;
}

let healthTimer = null;
async function checkHealth() {
  const banner = $("banner");
  let problems = [];
  try {
    const res = await fetch("/api/v1/health");
    const hl = await res.json();
    for (const part of ["store", "db"]) {
      const p = hl[part];
      if (p && p.ok === false) problems.push(`${part === "db" ? "metadata DB" : "episode store"} is down: ${p.error || "unreachable"}`);
    }
  } catch (e) {
    problems = [`the dashboard server is unreachable (${e.message})`];
  }
  banner.hidden = problems.length === 0;
  banner.textContent = problems.join(" · ");
  banner.className = problems.length ? "down" : "";
}

function globalKeys() {
  let g = false;
  document.addEventListener("keydown", (ev) => {
    if (typing(ev) || ev.ctrlKey || ev.metaKey || ev.altKey || document.querySelector("dialog[open]")) return;
    if (ev.key === "?") {
      $("help-dialog").showModal();
      ev.preventDefault();
      return;
    }
    if (g) {
      g = false;
      const to = { f: "/", e: "/episodes", r: "/rounds", h: "/help" }[ev.key];
      if (to) {
        navigate(to);
        ev.preventDefault();
      }
      return;
    }
    if (ev.key === "g") {
      g = true;
      setTimeout(() => (g = false), 1000);
    }
  });
}

/**
 * The token a link carries (`vla-rl dashboard` prints URL#token=... when it made a one-time token), taken
 * out of the address bar at once; null when there is none.
 */
function takeHashToken() {
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (!m) return null;
  history.replaceState(null, "", location.pathname + location.search);
  try {
    return decodeURIComponent(m[1]).trim() || null;
  } catch {
    return null;
  }
}

/** Whose token this is ({name, role}), or null when the server rejects it (401). */
async function whoIs(token) {
  const res = await fetch("/api/v1/session", { headers: { Authorization: `Bearer ${token}` } });
  if (res.status === 401) return null;
  if (!res.ok) throw new ApiError(res.status, `${res.status} ${res.statusText}`, "/session");
  return res.json();
}

const named = (who) => (who ? `${who.name} (${who.role})` : "a token this dashboard rejects");

/**
 * A link's token when another one is stored: never taken silently (the page would act as someone else
 * while you think you are you). The dialog names both identities; resolves true when the user switched.
 */
async function confirmSwitch(linked) {
  const [now, next] = await Promise.all([whoIs(getToken()).catch(() => null), whoIs(linked).catch(() => null)]);
  const dlg = $("switch-dialog");
  const use = $("switch-use");
  use.hidden = next === null;
  use.textContent = next ? `Switch to ${next.name}` : "Switch";
  $("switch-keep").textContent = now ? `Stay ${now.name}` : "Keep the stored token";
  $("switch-text").textContent = next
    ? `This link signs you in as ${named(next)}. You are signed in as ${named(now)}. Switch identity?`
    : `This link carries a token this dashboard rejects (401); you stay signed in as ${named(now)}.`;
  dlg.returnValue = "";
  dlg.showModal();
  await new Promise((resolve) => dlg.addEventListener("close", resolve, { once: true }));
  if (dlg.returnValue !== "switch" || next === null) return false;
  setToken(linked);
  return true;
}

/** A link's token: kept when none is stored (a first visit), else only once the user confirms. */
async function followLink(linked) {
  if (!linked || linked === getToken()) return;
  if (await confirmSwitch(linked)) {
    ctx.ready = loadSession().catch(() => false);
    if (await ctx.ready) render();
  }
}

async function main() {
  const linked = takeHashToken();
  if (linked && !getToken()) setToken(linked);
  $("token-form").addEventListener("submit", async () => {
    setToken($("token-input").value);
    $("token-input").value = "";
    ctx.ready = loadSession().catch(() => false);
    if (await ctx.ready) render();
    else askToken("That token was rejected (401): check it and try again.");
  });
  $("token-button").addEventListener("click", () => askToken("Enter a new access token."));
  $("help-button").addEventListener("click", () => $("help-dialog").showModal());
  window.addEventListener("vla:unauthorized", () => askToken("Your token was rejected (401): enter a valid one."));
  globalKeys();
  window.addEventListener("hashchange", () => followLink(takeHashToken()));

  // the session and the label schema load while the first page starts (pages await ctx.ready)
  ctx.ready = getToken() ? loadSession().catch(() => false) : Promise.resolve(false);
  if (!getToken()) $("session").textContent = "not signed in"; // the header always says who you are
  // another identity in the link: asked once the stored one's session is known (the header shows it)
  ctx.ready.then(() => followLink(linked));
  ctx.ready.then((ok) => {
    if (!ok && !(linked && linked !== getToken())) {
      askToken(getToken() ? "Your token was rejected (401): enter a valid one." : "The dashboard needs a token (ask the operator; it is kept in this browser only).");
    }
  });
  // the health banner's first request waits until the first page is drawn and painted (0.5 s after
  // it, or 2 s after start): it is not on the path to its first rows, and its answer would otherwise
  // land in the middle of their first frame
  const first = start($("page"), () => ctx);
  const health = () => {
    if (healthTimer !== null) return;
    healthTimer = setInterval(checkHealth, 10000);
    checkHealth();
  };
  setTimeout(health, 2000);
  await first.finally(() => setTimeout(health, 500));
}

// stopHealth before the first check also keeps it from starting (healthTimer no longer null)
window.vla = { ctx, can, checkHealth, stopHealth: () => clearInterval((healthTimer = healthTimer ?? 0)) };
main();
