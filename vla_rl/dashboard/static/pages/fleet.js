// Fleet: robots (from the collector's stats and the DB), success / intervention per checkpoint
// revision over time, policy servers (GetInfo), and the round lineage. Refreshes every 5 s.
import { api } from "../api.js";
import { LinePlot } from "../plot.js";
import { ago, badge, clear, colour, h, num, pct, short, showError, when } from "../util.js";

export async function render(root) {
  const err = h("div.err-slot");
  const robots = h("section.card", h("h2", "Robots"), h("p.muted", "loading…"));
  const plots = h("section.card.plots");
  const revisions = h("section.card");
  const servers = h("section.card", h("h2", "Policy servers"));
  const lineage = h("section.card", h("h2", "Round lineage"));
  root.append(h("h1", "Fleet"), err, robots, plots, h("div.grid2", servers, lineage), revisions);

  plots.append(h("h2", "Per checkpoint revision over time"));
  const row = h("div.grid2");
  plots.append(row);
  const success = new LinePlot(row, { title: "success rate", height: 160, time: true, yMin: 0, yMax: 1 });
  const interv = new LinePlot(row, { title: "intervention rate (frames under human control)", height: 160, time: true, yMin: 0, yMax: 1 });

  let stopped = false;
  let timer = null;
  const load = async () => {
    try {
      const f = await api("/fleet");
      showError(err, null);
      drawRobots(robots, f.robots || []);
      drawTimeline(success, interv, f.timeline || []);
      drawRevisions(revisions, f.revisions || []);
      drawServers(servers, f.servers || []);
      drawLineage(lineage, f.lineage || []);
    } catch (e) {
      showError(err, e, "fleet");
    }
    if (!stopped) timer = setTimeout(load, 5000);
  };
  await load();
  return () => {
    stopped = true;
    clearTimeout(timer);
    success.destroy();
    interv.destroy();
  };
}

function drawRobots(el, robots) {
  const rows = robots.map((r) =>
    h(
      "tr",
      { dataset: { robot: r.robot_id } },
      h("td", h("span.dot", { class: `dot ${r.connected ? "on" : "off"}`, title: r.connected ? "connected" : "not connected" }), " ", h("a", { href: `/episodes?robot=${encodeURIComponent(r.robot_id)}` }, r.robot_id)),
      h("td.num", num(r.episodes_hour)),
      h("td.num", pct(r.success_hour)),
      h("td.num", num(r.episodes_day)),
      h("td.num", pct(r.success_day)),
      h("td.num", num(r.episodes)),
      h("td.num", pct(r.intervention_rate)),
      h("td.num", `${num(r.frames_received)} / ${num(r.frames_stored)}`),
      h("td.mono", { title: r.revision || "" }, short(r.revision)),
    ),
  );
  clear(
    el,
    h("h2", `Robots (${robots.length})`),
    robots.length
      ? h(
          "table.robots",
          h("thead", h("tr", ["robot", "episodes 1 h", "success 1 h", "episodes 1 d", "success 1 d", "episodes", "intervention", "frames recv / stored", "revision"].map((c) => h("th", c)))),
          h("tbody", rows),
        )
      : h("p.muted", "No robot has reported yet."),
  );
}

function drawTimeline(success, interv, timeline) {
  const byRev = new Map();
  for (const p of timeline) {
    if (!byRev.has(p.revision)) byRev.set(p.revision, []);
    byRev.get(p.revision).push(p);
  }
  const xs = [...new Set(timeline.map((p) => p.t))].sort((a, b) => a - b);
  const series = (field) =>
    [...byRev.entries()].map(([rev, pts], i) => {
      const m = new Map(pts.map((p) => [p.t, p[field]]));
      return { name: short(rev), color: colour(rev, i), values: xs.map((t) => (m.has(t) ? m.get(t) : null)), points: true };
    });
  success.setData({ x: xs, series: series("success_rate") });
  interv.setData({ x: xs, series: series("intervention_rate") });
}

function drawRevisions(el, revs) {
  clear(
    el,
    h("h2", "Checkpoint revisions"),
    revs.length
      ? h(
          "table",
          h("thead", h("tr", ["revision", "first seen", "episodes", "success", "intervention"].map((c) => h("th", c)))),
          h(
            "tbody",
            revs.map((r) =>
              h(
                "tr",
                h("td.mono", h("a", { href: `/episodes?revision=${encodeURIComponent(r.revision)}`, title: r.revision }, short(r.revision))),
                h("td", { title: when(r.first_seen) }, ago(r.first_seen)),
                h("td.num", num(r.episodes)),
                h("td.num", pct(r.success_rate)),
                h("td.num", pct(r.intervention_rate)),
              ),
            ),
          ),
        )
      : h("p.muted", "No episodes yet."),
  );
}

function drawServers(el, servers) {
  clear(
    el,
    h("h2", "Policy servers"),
    servers.length
      ? h(
          "table.servers",
          h("thead", h("tr", ["server", "commit", "follows", "req/s", "p50 ms", "p99 ms", "served"].map((c) => h("th", c)))),
          h(
            "tbody",
            servers.map((s) =>
              h(
                "tr",
                { dataset: { address: s.address, commit: s.commit || "" } },
                h("td", h("span", { class: `dot ${s.ok ? "on" : "off"}`, title: s.ok ? "serving" : s.error || "down" }), " ", s.address, s.ok ? null : h("div.error.small", s.error || "unreachable")),
                h("td.mono.commit", { title: s.commit || "" }, short(s.commit)),
                h("td", s.followed_ref || "–"),
                h("td.num", num(s.requests_per_s, 1)),
                h("td.num", num(s.p50_ms, 1)),
                h("td.num", num(s.p99_ms, 1)),
                h("td.num", num(s.served)),
              ),
            ),
          ),
        )
      : h("p.muted", "No policy server configured (--server ADDR)."),
  );
}

function drawLineage(el, lineage) {
  const items = [...lineage].sort((a, b) => a.round - b.round);
  clear(
    el,
    h("h2", "Round lineage"),
    items.length
      ? h(
          "ol.lineage",
          items.map((r) =>
            h(
              "li",
              { class: r.promoted ? "promoted" : "" },
              h("span.mono", { title: r.base_revision || "" }, short(r.base_revision)),
              " → ",
              h("a", { href: `/rounds/${r.round}` }, r.tag || `round-${r.round}`),
              " ",
              h("span.mono.muted", { title: r.checkpoint_revision || "" }, short(r.checkpoint_revision)),
              " ",
              badge(r.status, `st-${r.status}`),
              r.promoted ? badge("promoted", "promoted") : null,
            ),
          ),
        )
      : h("p.muted", "No rounds yet."),
  );
}
