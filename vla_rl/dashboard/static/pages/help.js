// Help queue: robots that asked for an operator (their alarm fired, or they asked), most urgent first,
// then oldest, with how long each has waited. Polls every 2 s (nothing to reload). "Take next" claims the
// request at the head of the queue, "Take" a chosen one (operator role); the robot polls its request and
// hands control over. Each row links to the robot's episode page (cameras and timeline). Below, the requests
// closed last: who took each (a person, or a simulated operator "sim-operator-K") and how it ended.
import { api, ApiError } from "../api.js";
import { badge, clear, h, showError } from "../util.js";

const POLL_MS = 2000;

/** "12 s", "3 min 4 s", "2 h 5 min": how long a robot has waited. */
export function waited(s) {
  const t = Math.max(0, Math.round(s));
  if (t < 60) return `${t} s`;
  if (t < 3600) return `${Math.floor(t / 60)} min ${t % 60} s`;
  return `${Math.floor(t / 3600)} h ${Math.floor((t % 3600) / 60)} min`;
}

export async function render(root, ctx) {
  await ctx.ready;
  const err = h("div.err-slot");
  const mine = h("div.help-mine");
  const takeNext = h("button#help-take-next.primary", { type: "button" }, "Take next robot");
  const count = h("span.muted.help-count", "");
  const list = h("section.card.help-list", h("p.muted", "loading…"));
  const recent = h("section.card.help-recent");
  root.append(h("h1", "Help queue"), err, h("div.help-bar", takeNext, " ", count), mine, list, recent);
  let stopped = false;
  let timer = null;
  let busy = false;

  const canOp = () => ctx.can("operator");
  const me = () => (ctx.session ? ctx.session.name : null);

  const claim = async (requestId) => {
    if (busy) return;
    busy = true;
    try {
      await api("/help/claim", { method: "POST", body: requestId ? { request_id: requestId } : {} });
      showError(err, null);
    } catch (e) {
      showError(err, e, "take");
    } finally {
      busy = false;
    }
    load();
  };

  const resolve = async (requestId) => {
    try {
      await api(`/help/${requestId}/resolve`, { method: "POST", body: { note: "" } });
      showError(err, null);
    } catch (e) {
      showError(err, e, "resolve");
    }
    load();
  };
  takeNext.addEventListener("click", () => claim(null));

  function row(r) {
    const open = r.status === "open";
    const ours = r.status === "claimed" && r.claimed_by === me();
    const action = open
      ? h("button.help-take", { type: "button", disabled: !canOp(), onclick: () => claim(r.id) }, "Take")
      : ours
        ? h("button.help-resolve", { type: "button", onclick: () => resolve(r.id) }, "Resolve")
        : null;
    return h(
      "tr",
      { dataset: { request: String(r.id), status: r.status } },
      h("td.num", r.urgency.toFixed(2)),
      h("td", h("a", { href: `/episodes?robot=${encodeURIComponent(r.robot_id)}` }, r.robot_id)),
      h("td.num.help-waited", waited(r.waited_s)),
      h("td", r.reason),
      h("td", open ? badge("open", "flag") : badge(`${r.status} by ${r.claimed_by || "?"}`, "")),
      h("td", h("a.help-episode", { href: r.episode_url }, "cameras & timeline")),
      h("td", action),
    );
  }

  function draw(res) {
    const reqs = res.requests || [];
    count.textContent = `${res.open} waiting`;
    takeNext.disabled = !canOp() || res.open === 0;
    takeNext.title = canOp() ? "" : "needs the operator role";
    const held = reqs.filter((r) => r.status === "claimed" && r.claimed_by === me());
    clear(
      mine,
      held.map((r) =>
        h("p.help-held", "You have ", h("b", r.robot_id), ": ", h("a", { href: r.episode_url }, "open its cameras & timeline"), " · ", h("button.help-resolve", { type: "button", onclick: () => resolve(r.id) }, "Resolve")),
      ),
    );
    clear(
      list,
      h("h2", `Requests (${reqs.length})`),
      reqs.length
        ? h(
            "table.help",
            h("thead", h("tr", ["urgency", "robot", "waited", "reason", "status", "episode", ""].map((c) => h("th", c)))),
            h("tbody", reqs.map(row)),
          )
        : h("p.muted", "No robot is asking for help."),
    );
    const closed = res.recent || [];
    clear(
      recent,
      closed.length ? h("h2", "Closed last") : null,
      closed.length
        ? h(
            "table.help-closed",
            h("thead", h("tr", ["robot", "taken by", "status", "how it ended", "episode"].map((c) => h("th", c)))),
            h(
              "tbody",
              closed.map((r) =>
                h(
                  "tr",
                  { dataset: { closed: String(r.id), status: r.status } },
                  h("td", r.robot_id),
                  h("td.help-by", r.claimed_by || "nobody"),
                  h("td", r.status),
                  h("td.help-note", r.note || ""),
                  h("td", h("a.help-episode", { href: r.episode_url }, "cameras & timeline")),
                ),
              ),
            ),
          )
        : null,
    );
  }

  async function load() {
    clearTimeout(timer);
    try {
      draw(await api("/help"));
      showError(err, null);
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 409)) showError(err, e, "help queue");
    }
    if (!stopped) timer = setTimeout(load, POLL_MS);
  }
  load(); // not awaited: the page is there at once, the list fills in
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
