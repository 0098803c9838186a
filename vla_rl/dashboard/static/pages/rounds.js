// Rounds: the list (status, algorithm, base, the gate's candidate vs base success with intervals, the held-out success, promoted),
// the start form (algorithm + preset, base from the registry's refs, data selection pre-filled from
// the episode filter with its live count, margin), live progress over SSE (fetch streaming), cancel,
// promote and roll back behind a confirmation.
import { api, queryString, sse } from "../api.js";
import { forbiddenText } from "../labels.js";
import { LinePlot } from "../plot.js";
import { navigate } from "../router.js";
import { ago, badge, clear, confirmDialog, debounce, h, num, pct, short, showError, when } from "../util.js";

const ACTIVE = new Set(["queued", "running"]);

const roundNo = (r) => r.id;

/** Seconds -> "1 h 05 min" / "3 min 20 s" / "12 s". */
export function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "";
  s = Math.max(0, Math.round(s));
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${s} s`;
}

/** A progress bar with "done / total unit" and the ETA. */
function bar(label, done, total, unit, eta) {
  const frac = total ? Math.min(1, done / total) : 0;
  return h(
    `div.bar.bar-${label.split(" ")[0]}`,
    h("b", `${label} `),
    h("progress", { max: total || 1, value: done || 0 }),
    h("span.mono", ` ${num(done)} / ${num(total)} ${unit} (${pct(frac)})`),
    eta !== null && eta !== undefined && done < total ? h("span.muted.eta", ` · ETA ${duration(eta)}`) : null,
  );
}

export async function render(root, ctx) {
  await ctx.ready;
  const err = h("div.err-slot");
  const list = h("section.card.rounds-list", h("h2", "Rounds"), h("p.muted", "loading…"));
  const detail = h("section.card.round-detail");
  const formCard = h("section.card.round-form");
  const n = ctx.params.n !== undefined ? Number(ctx.params.n) : null;
  root.append(h("h1", "Rounds"), err, h("div.grid2.rounds-top", formCard, n !== null ? detail : list));
  if (n !== null) root.append(list);
  const cleanups = [];
  let stopped = false;

  // ---- refs + rollback, the algorithms and presets the server knows --------------------------
  let refs = { repo: "", refs: [] };
  let catalogue = { algorithms: [], round_knobs: [] };
  const [refsRes, algosRes] = await Promise.allSettled([api("/refs"), api("/algorithms")]);
  if (refsRes.status === "fulfilled") refs = refsRes.value;
  else showError(err, refsRes.reason, "refs");
  if (algosRes.status === "fulfilled") catalogue = algosRes.value;
  else showError(err, algosRes.reason, "algorithms");

  // ---- the list ------------------------------------------------------------------------------
  let listTimer = null;
  const loadList = async () => {
    clearTimeout(listTimer);
    try {
      const res = await api("/rounds");
      drawList(res.rounds); // GET /rounds answers {rounds: [round summary, ...]}
    } catch (e) {
      showError(err, e, "rounds");
    }
    if (!stopped) listTimer = setTimeout(loadList, 5000);
  };

  function drawList(rounds) {
    const canOp = ctx.can("operator");
    const refName = refs.promote_ref || "prod";
    const prod = (refs.refs || []).find((r) => r.name === refName);
    clear(
      list,
      h(
        "div.toolbar",
        h("h2", "Rounds"),
        h("span.spacer"),
        prod ? h("span.muted", `${refName} → ${short(prod.commit)}`) : null,
        h("button.danger", { type: "button", disabled: !canOp || !prod, title: canOp ? `move ${refName} back to the commit it pointed at before` : forbiddenText(null, ctx.session, "roll back"), onclick: () => rollback(refName) }, `Roll back ${refName}`),
      ),
      rounds.length
        ? h(
            "table.rounds",
            h("thead", h("tr", ["#", "status", "algo", "base", "gate: candidate vs base", "held-out success", "promoted", "created"].map((c) => h("th", c)))),
            h(
              "tbody",
              rounds.map((r) =>
                h(
                  "tr",
                  { dataset: { round: roundNo(r), status: r.status }, class: roundNo(r) === n ? "cursor" : "" },
                  h("td", h("a", { href: `/rounds/${roundNo(r)}` }, `round-${roundNo(r)}`)),
                  h("td", badge(r.status, `st-${r.status}`, r.error || "")),
                  h("td", r.algo, r.preset ? h("span.muted", ` (${r.preset})`) : null),
                  h("td.mono", { title: `${r.base_ref || ""} ${r.base_revision || ""}` }, r.base_ref || "", " ", h("span.muted", short(r.base_revision))),
                  h("td", compareCell(scores(r))),
                  h("td", reportedCell(scores(r))),
                  h("td", r.promoted ? badge("promoted", "promoted") : "–"),
                  h("td", { title: when(r.created_at) }, ago(r.created_at)),
                ),
              ),
            ),
          )
        : h("p.muted", "No rounds yet: start one with the form."),
    );
  }

  async function rollback(ref) {
    if (!(await confirmDialog(`Roll back ${ref}?`, `Move ${ref} back to the commit it pointed at before; servers following it will swap.`, "Roll back"))) return;
    try {
      const res = await api(`/refs/${encodeURIComponent(ref)}/rollback`, { method: "POST" });
      showError(err, null);
      clear(err, h("div.ok", `${ref} → ${short(res && (res.commit || res.revision))}`));
      refs = await api("/refs").catch(() => refs);
      loadList();
    } catch (e) {
      if (e.status === 403) clear(err, h("div.error", { role: "alert" }, forbiddenText(e, ctx.session, "roll back")));
      else showError(err, e, "rollback");
    }
  }

  // ---- the start form ------------------------------------------------------------------------
  drawForm();
  function drawForm() {
    const algos = catalogue.algorithms || [];
    const modes = (a) => [a.offline ? "offline" : null, a.online ? "online" : null].filter(Boolean).join(" + ");
    const algo = h(
      "select",
      { name: "algo" },
      algos.map((a) => h("option", { value: a.name, title: a.summary }, `${a.name} (${modes(a)})`)),
    );
    const preset = h("select", { name: "preset" });
    const about = h("p.small.muted.algo-about");
    const knobsList = h("details.small.knobs");
    const fillPresets = () => {
      const a = algos.find((x) => x.name === algo.value);
      clear(preset, h("option", { value: "" }, "none"), (a ? a.presets : []).map((p) => h("option", { value: p.name, title: p.summary }, p.name)));
      describe();
    };
    const describe = () => {
      const a = algos.find((x) => x.name === algo.value);
      const p = a && a.presets.find((x) => x.name === preset.value);
      const knobs = a ? [...a.knobs, ...(catalogue.round_knobs || [])] : [];
      clear(
        knobsList,
        h("summary", `${knobs.length} knobs options may set`),
        h("ul.mono", knobs.map((k) => h("li", `${k.name}: ${k.type} = ${JSON.stringify(k.default)}`))),
      );
      clear(
        about,
        a ? a.summary : "",
        p ? h("span", h("br"), h("b", `${p.name}: `), p.summary, h("br"), h("span.mono", JSON.stringify(p.values))) : null,
      );
    };
    algo.addEventListener("change", fillPresets);
    preset.addEventListener("change", describe);
    const base = h(
      "select",
      { name: "base" },
      (refs.refs || []).map((r) => h("option", { value: `hub://${refs.repo}@${r.name}`, selected: r.name === "prod" }, `${r.name} (${short(r.commit)})`)),
      h("option", { value: "" }, "other…"),
    );
    const baseOther = h("input", { name: "base_other", placeholder: "hub://org/repo@ref", hidden: base.value !== "" });
    base.addEventListener("change", () => (baseOther.hidden = base.value !== ""));
    const data = h("input", { name: "data", placeholder: "robot=arm-1,label.quality=good,since=2026-11-01", size: 40 });
    const task = h("input", { name: "task", placeholder: "from the base checkpoint" });
    const margin = h("input", { name: "margin", type: "number", step: "0.01", min: "-0.99", max: "0.99", value: "0" });
    const options = h("textarea", { name: "options", rows: 3, placeholder: '{"steps": 20, "eval_episodes": 10}' });
    fillPresets();
    const count = h("div.selection-count.muted", { "aria-live": "polite" });
    const formErr = h("div.err-slot");
    const submit = h("button.primary", { type: "submit", disabled: !ctx.can("operator"), title: ctx.can("operator") ? "" : forbiddenText(null, ctx.session, "start rounds") }, "Start round");
    const updateCount = debounce(async () => {
      try {
        const res = await api(`/selection${queryString({ data: data.value, task: task.value })}`);
        clear(count, `selects ${num(res.episodes)} episodes · ${num(res.frames)} frames`);
        count.classList.toggle("error", !res.episodes);
      } catch (e) {
        clear(count, h("span.error", e.text || e.message));
      }
    }, 250);
    data.addEventListener("input", updateCount);
    task.addEventListener("input", updateCount);
    if (ctx.query.get("filter") !== null) {
      // the episode filter as selection text: the server translates it (one selection language), unless
      // the fields were typed in meanwhile
      api(`/selection/from-filter?${ctx.query.get("filter")}`)
        .then((sel) => {
          if (!data.value) data.value = sel.data || "";
          if (!task.value) task.value = sel.task || "";
          updateCount();
        })
        .catch((e) => {
          if (!data.value) clear(count, h("span.error", `the episode filter: ${e.text || e.message}`));
        });
    }
    updateCount();
    const form = h(
      "form",
      { onsubmit: (ev) => start(ev) },
      h("label", h("span", "algorithm"), algo),
      h("label", h("span", "preset"), preset),
      about,
      h("label", h("span", "base"), base, baseOther),
      h("label", h("span", "task"), task),
      h("label.wide", h("span", "data selection"), data),
      count,
      h("label", h("span", "margin"), margin),
      h("label.wide", h("span", "options (JSON: trainer and round fields)"), options),
      knobsList,
      formErr,
      h("menu", submit),
    );
    clear(formCard, h("h2", "Start a round"), form);

    async function start(ev) {
      ev.preventDefault();
      let opts;
      if (options.value.trim()) {
        try {
          opts = JSON.parse(options.value);
        } catch (e) {
          return clear(formErr, h("div.error", { role: "alert" }, `options: expected a JSON object (${e.message})`));
        }
      }
      const body = { algo: algo.value, base: base.value || baseOther.value.trim(), data: data.value.trim() };
      if (preset.value) body.preset = preset.value;
      if (task.value.trim()) body.task = task.value.trim();
      if (margin.value !== "") body.margin = Number(margin.value);
      if (opts) body.options = opts;
      submit.disabled = true;
      try {
        const res = await api("/rounds", { method: "POST", body });
        clear(formErr);
        navigate(`/rounds/${roundNo(res)}`);
      } catch (e) {
        if (e.status === 403) clear(formErr, h("div.error", { role: "alert" }, forbiddenText(e, ctx.session, "start rounds")));
        else showError(formErr, e);
        submit.disabled = false;
      }
    }
  }

  // ---- one round: detail + live progress -----------------------------------------------------
  if (n !== null) await showRound(n);

  async function showRound(no) {
    let r;
    try {
      r = await api(`/rounds/${no}`);
    } catch (e) {
      clear(detail, h("div.error", { role: "alert" }, `round ${no}: ${e.text || e.message}`));
      return;
    }
    const head = h("div.toolbar");
    const info = h("div.round-info");
    const progress = h("div.progress");
    const actions = h("div.actions");
    const msg = h("div.err-slot");
    const curveSlot = h("div", { hidden: true });
    const lastLoss = h("div.muted.small");
    clear(detail, head, progress, lastLoss, curveSlot, info, actions, msg);
    const curve = new LinePlot(curveSlot, { title: "training loss", height: 140, legend: false });
    cleanups.push(() => curve.destroy());
    const losses = { x: [], y: [] };
    const drawAll = (rec) => {
      r = rec;
      clear(head, h("h2", `round-${roundNo(r)}`), badge(r.status, `st-${r.status}`), r.promoted ? badge("promoted", "promoted") : null);
      drawInfo(info, r);
      drawProgress(r.progress || {});
      const live = liveLoss(r);
      const mc = (r.metrics && r.metrics.curve) || null;
      if (live) setCurve(live);
      else if (mc && !losses.x.length) setCurve(mc);
      drawActions();
    };
    // c: a running round's live curve ([step, value] pairs, liveLoss) or a finished one's metrics.curve
    // (the trainer's rows, {step, loss, ...})
    const setCurve = (c) => {
      losses.x = [];
      losses.y = [];
      for (const p of c) {
        const [x, y] = Array.isArray(p) ? p : [p.step, p.loss];
        if (y !== undefined && y !== null) {
          losses.x.push(x);
          losses.y.push(y);
        }
      }
      curveSlot.hidden = losses.x.length < 2; // one point is a number, not a curve
      clear(lastLoss, losses.x.length ? `training loss ${num(losses.y[losses.y.length - 1], 4)} at step ${losses.x[losses.x.length - 1]}` : "");
      curve.setData({ x: losses.x, series: [{ values: losses.y, color: "#4e79a7", width: 1.5, points: losses.x.length < 30 }] });
    };
    // p: what the worker last wrote (vla_rl.rounds.ProgressWriter): phase, since, stage, step,
    // total_steps, eta_s, evaluating (base | candidate), episodes_done, episodes_total, eval_eta_s
    const drawProgress = (p) => {
      const active = ACTIVE.has(r.status);
      const hasSteps = typeof p.step === "number" && typeof p.total_steps === "number";
      const hasEval = typeof p.episodes_done === "number" && typeof p.episodes_total === "number";
      clear(
        progress,
        active
          ? h("div", h("b", "phase "), h("span.phase", p.phase || r.status), p.since ? h("span.muted", ` (${ago(p.since)})`) : null)
          : h("div", h("b", "finished "), h("span.phase", r.status), r.finished_at ? h("span.muted", ` (${ago(r.finished_at)})`) : null),
        hasSteps ? bar(`${p.stage || "train"} steps`, p.step, p.total_steps, "", active ? p.eta_s : null) : null,
        hasEval ? bar(`evaluation${p.evaluating ? ` (${p.evaluating})` : ""}`, p.episodes_done, p.episodes_total, "episodes", active ? p.eval_eta_s : null) : null,
      );
    };
    const drawActions = () => {
      const canOp = ctx.can("operator");
      const why = canOp ? "" : forbiddenText(null, ctx.session, "run rounds");
      clear(
        actions,
        ACTIVE.has(r.status) ? h("button.danger", { type: "button", disabled: !canOp, title: why, onclick: cancel }, "Cancel round") : null,
        r.status === "succeeded" && !r.promoted && r.checkpoint_revision ? h("button.primary", { type: "button", disabled: !canOp, title: why, onclick: promote }, "Promote to prod") : null,
      );
    };
    async function cancel() {
      if (!(await confirmDialog(`Cancel round-${no}?`, "A queued round will not start; a running one stops at its next heartbeat.", "Cancel round"))) return;
      try {
        await api(`/rounds/${no}/cancel`, { method: "POST" });
        drawAll(await api(`/rounds/${no}`));
        clear(msg);
        loadList();
      } catch (e) {
        if (e.status === 403) clear(msg, h("div.error", { role: "alert" }, forbiddenText(e, ctx.session, "cancel rounds")));
        else showError(msg, e, "cancel");
      }
    }
    async function promote() {
      if (!(await confirmDialog(`Promote round-${no}?`, `Move prod to ${short(r.checkpoint_revision)}; servers following prod will swap to it.`, "Promote"))) return;
      try {
        await api(`/rounds/${no}/promote`, { method: "POST" });
        clear(msg, h("div.ok", `prod → ${short(r.checkpoint_revision)}`));
        drawAll(await api(`/rounds/${no}`));
        refs = await api("/refs").catch(() => refs);
        loadList();
      } catch (e) {
        if (e.status === 403) clear(msg, h("div.error", { role: "alert" }, forbiddenText(e, ctx.session, "promote")));
        else showError(msg, e, "promote");
      }
    }
    drawAll(r);
    if (ACTIVE.has(r.status)) {
      const ac = new AbortController();
      cleanups.push(() => ac.abort());
      const follow = async () => {
        try {
          await sse(
            `/rounds/${no}/events`,
            (name, data) => {
              if (name === "progress" && data && typeof data === "object") {
                if (data.status) {
                  const before = r.status;
                  r = { ...r, ...data };
                  if (before !== r.status) drawAll(r);
                  else drawProgress(r.progress || {});
                  const live = liveLoss(data);
                  if (live) setCurve(live);
                } else {
                  r.progress = data;
                  drawProgress(data);
                }
              } else if (name === "error") {
                showError(msg, { text: data && data.message ? `${data.field || "progress"}: ${data.message}` : String(data) });
              } else if (name === "done") {
                return false;
              }
            },
            { signal: ac.signal },
          );
        } catch (e) {
          if (!ac.signal.aborted) showError(msg, e, "progress stream");
        }
        if (!ac.signal.aborted) {
          drawAll(await api(`/rounds/${no}`).catch(() => r));
          loadList();
          if (ACTIVE.has(r.status)) setTimeout(follow, 1000);
        }
      };
      follow();
    }
  }

  await loadList();
  return () => {
    stopped = true;
    clearTimeout(listTimer);
    cleanups.forEach((f) => f());
  };
}

/** The training loss of a running round's live curve ({tag: [[step, value]]}), if it has one. */
function liveLoss(r) {
  const c = r && r.live_curve;
  if (!c || typeof c !== "object") return null;
  const tag = "train/loss" in c ? "train/loss" : Object.keys(c).find((k) => k.endsWith("loss"));
  return tag && c[tag] && c[tag].length ? c[tag] : null;
}

/** The round's scores: top-level in the API's round summary, else in its metrics. */
function scores(r) {
  return r.success !== undefined && r.success !== null ? r : r.action_mse != null ? r : r.metrics || {};
}

/** Candidate vs base success with their 95% intervals, as text and a small SVG. */
function compareCell(m) {
  if (m.success == null && m.action_mse == null) return "–";
  const mse = `action MSE ${num(m.action_mse, 4)} vs base ${num(m.base_action_mse, 4)}`;
  if (m.success == null && m.estimated_success != null)  // no simulator: gated on the learned success estimate
    return `estimated success ${pct(m.estimated_success)} vs base ${pct(m.base_estimated_success)} · ${mse}`;
  if (m.success == null) return mse;
  const W = 120;
  const bar = (v, ci, y, cls) => [
    ci ? h("line", { x1: ci[0] * W, x2: ci[1] * W, y1: y, y2: y, class: `ci ${cls}` }) : null,
    h("rect", { x: v * W - 2, y: y - 3, width: 4, height: 6, class: cls }),
  ];
  const fmtCi = (ci) => (ci ? ` [${pct(ci[0])}, ${pct(ci[1])}]` : "");
  return h(
    "span.compare",
    { title: `candidate ${pct(m.success)}${fmtCi(m.ci95)} vs base ${pct(m.base_success)}${fmtCi(m.base_ci95)}${m.gate ? ` · ${m.gate.reason}` : ""}` },
    h("svg", { width: W, height: 16, class: "ci-chart" }, h("line", { x1: 0, x2: W, y1: 15, y2: 15, class: "axis" }), bar(m.base_success ?? 0, m.base_ci95, 11, "base"), bar(m.success, m.ci95, 4, "cand")),
    ` ${pct(m.success)} vs ${pct(m.base_success)}`,
    m.delta !== undefined ? h("span", { class: m.delta > 0 ? "up" : m.delta < 0 ? "down" : "muted" }, ` (${m.delta > 0 ? "+" : ""}${(100 * m.delta).toFixed(0)} pts)`) : null,
  );
}

/** The success a promoted round reports: its checkpoint on seeds the gate never saw (vla_rl/gate.py). */
function reportedCell(m) {
  if (m.reported_success == null) return m.success == null ? "–" : h("span.muted", "not measured");
  const ci = m.reported_ci95;
  return `${pct(m.reported_success)}${ci ? ` [${pct(ci[0])}, ${pct(ci[1])}]` : ""}${m.report_episodes ? ` on ${m.report_episodes} seeds` : ""}`;
}

function drawInfo(el, r) {
  const m = { ...(r.metrics || {}), ...Object.fromEntries(Object.entries(scores(r)).filter(([, v]) => v != null)) };
  const rows = [
    ["algorithm", `${r.algo}${r.preset ? ` (preset ${r.preset})` : ""}`],
    ["task", r.task],
    ["base", `${r.base_ref || ""} ${short(r.base_revision)}`],
    ["data", typeof r.data === "string" ? r.data || "(all)" : r.data == null ? "(all)" : JSON.stringify(r.data)],
    ["margin", r.margin != null ? String(r.margin) : "–"],
    ["gate: candidate vs base", compareCell(m)],
    ["held-out success", reportedCell(m)],
    ["gate", m.gate ? `${m.gate.passed ? "passed" : "not passed"}: ${m.gate.reason}` : "–"],
    ["checkpoint", r.checkpoint_ref ? `${r.checkpoint_ref} ${short(r.checkpoint_revision)}` : "–"],
    ["worker", r.worker ? `${r.worker} (attempt ${r.attempts})` : "–"],
    ["created", when(r.created_at)],
    ["finished", when(r.finished_at)],
  ];
  clear(el, h("table.kv", h("tbody", rows.map(([k, v]) => h("tr", h("th", k), h("td", v))))), r.error ? h("pre.error", r.error) : null);
}
