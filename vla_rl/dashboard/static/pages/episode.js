// Episode: synchronised camera playback, the timeline (controller segments, span labels, reward),
// executed vs proposed action / reward / state plots on one cursor, keyboard span labelling, episode
// labels (outcome override, failure taxonomy, note) and the append-only label history with undo.
import { api } from "../api.js";
import { activeEvents, currentSpans, currentValues, forbiddenText, normaliseSchema, spanShortcuts } from "../labels.js";
import { Player } from "../player.js";
import { LinePlot } from "../plot.js";
import { setQuery } from "../router.js";
import { Timeline, SPAN_COLOURS } from "../timeline.js";
import { badge, clear, colour, h, num, short, typing, when, debounce } from "../util.js";

const cameraNames = (ep) => (ep.cameras || []).map((c) => (typeof c === "string" ? c : c.name));
const fpsOf = (ep) => Number(ep.fps ?? ep.control_hz ?? ep.rate_hz ?? ep.control_rate_hz ?? ep.spec?.control_hz ?? 20) || 20;
const historyOf = (ep) => ep.history || ep.label_history || [];

export async function render(root, ctx) {
  const id = ctx.params.id;
  const msg = h("div.msg", { role: "status" });
  let ep;
  try {
    ep = await api(`/episodes/${encodeURIComponent(id)}`);
  } catch (e) {
    root.append(h("h1", `Episode ${short(id)}`), h("div.error", { role: "alert" }, `episode: ${e.text || e.message}`));
    return;
  }
  const length = ep.length;
  const fps = fpsOf(ep);
  const cams = cameraNames(ep);
  const startT = Math.max(0, Math.min(length - 1, parseInt(ctx.query.get("t") || "0", 10) || 0));
  const state = { t: startT, mark: [null, null], ep };

  // frames first: the player starts fetching before the rest of the page (and the session) is there
  const stage = h("div.stage");
  let uiReady = false;
  let setPlaying = () => {};
  const player = new Player(stage, {
    episodeId: ep.id,
    cameras: cams,
    length,
    fps,
    onFrame: (t) => uiReady && onFrame(t),
    onState: (playing) => setPlaying(playing),
  });
  if (cams.length) player.seek(startT);
  await ctx.ready;
  const schema = normaliseSchema(ctx.schema);
  const digits = spanShortcuts(schema);

  // --- header ---------------------------------------------------------------------------------
  const outcomeBadge = h("span");
  const flags = Object.entries(ep.flags || {}).map(([k, f]) => badge(k, "flag", `${k}: ${f.detail || ""} (score ${Number(f.score).toFixed(2)})`));
  root.append(
    h(
      "div.ep-head",
      h("a.back", { href: sessionStorage.getItem("vla:last-episodes") || "/episodes" }, "← episodes"),
      h("h1", "Episode ", h("span.mono", ep.id)),
      h("span", ep.robot_id),
      h("span", ep.task),
      outcomeBadge,
      h("span.muted", `${length} frames · ${fps} Hz · ${(length / fps).toFixed(1)} s`),
      h("span.mono.muted", (ep.revisions || []).map(short).join(" ")),
      flags,
    ),
  );
  if (ep.instruction) root.append(h("p.instruction", `“${ep.instruction}”`));

  // --- player + controls -----------------------------------------------------------------------
  const playBtn = h("button.play", { type: "button", title: "play / pause (space)", "aria-label": "play" }, "▶");
  const frameOut = h("output.frame", { "aria-live": "off" });
  const markOut = h("span.mark-out.muted");
  const left = h("div.ep-main");
  const side = h("aside.ep-side");
  root.append(h("div.ep-layout", left, side));
  left.append(stage);
  let plots = [];
  const timelineSlot = h("div");
  setPlaying = (playing) => {
    playBtn.textContent = playing ? "❚❚" : "▶";
    playBtn.setAttribute("aria-label", playing ? "pause" : "play");
    root.dataset.playing = playing ? "true" : "false";
  };
  if (!cams.length) stage.append(h("p.muted", "This episode has no camera."));
  playBtn.addEventListener("click", () => player.toggle());
  const spanButtons = h(
    "div.span-buttons",
    digits.map((d, i) => h("button", { type: "button", dataset: { value: d.value }, style: { borderColor: SPAN_COLOURS[d.value] || colour(d.value) }, title: `label the marked span ${d.key}=${d.value} (${i + 1})`, onclick: () => labelSpan(i) }, h("kbd", i + 1), ` ${d.value}`)),
  );
  left.append(h("div.controls", playBtn, frameOut, player.status, player.bufferOut, h("span.spacer"), markOut, spanButtons), msg, timelineSlot);
  const timeline = new Timeline(timelineSlot, { length, fps, onSeek: (t) => player.seek(t) });
  timeline.setSegments(ep.segments || []);
  const legend = h("div.legend", ["policy", "human", "scripted"].map((k) => h("span", h("i", { style: { background: `var(--${k})` } }), k)));
  timelineSlot.append(legend);
  const plotSlot = h("div.ep-plots");
  left.append(plotSlot);

  // --- labels side panel ----------------------------------------------------------------------
  const labelPanel = h("section.card.labels-panel");
  const historyPanel = h("section.card.history");
  side.append(labelPanel, historyPanel);

  const urlT = debounce((t) => {
    const q = new URLSearchParams(location.search);
    if (t) q.set("t", t);
    else q.delete("t");
    setQuery(q);
  }, 250);

  function onFrame(t) {
    state.t = t;
    frameOut.textContent = `frame ${t} / ${length - 1} · ${(t / fps).toFixed(2)} s`;
    timeline.setCursor(t);
    for (const p of plots) p.setCursor(t);
    if (state.mark[0] !== null && state.mark[1] === null) timeline.setMark(state.mark[0], t + 1);
    urlT(t);
  }

  function say(text, cls = "ok") {
    clear(msg, text ? h(`div.${cls}`, { role: cls === "error" ? "alert" : undefined }, text) : null);
  }

  function sayError(e, what) {
    if (e.status === 403) say(forbiddenText(e, ctx.session), "error");
    else say(`${what}: ${e.text || e.message}`, "error");
  }

  function drawMark() {
    const [a, b] = state.mark;
    if (a === null) {
      markOut.textContent = "[ ] mark a span";
      timeline.setMark(null);
    } else {
      markOut.textContent = b === null ? `span [${a} … (press ])` : `span [${a}, ${b}) · ${b - a} frames · 1–${digits.length} to label`;
      timeline.setMark(a, b ?? state.t + 1);
    }
  }

  function markStart() {
    state.mark = [state.t, null];
    drawMark();
  }

  function markEnd() {
    let [a] = state.mark;
    let b = state.t + 1;
    if (a === null) a = state.t;
    if (b <= a) [a, b] = [state.t, a + 1];
    state.mark = [a, b];
    drawMark();
  }

  async function labelSpan(i) {
    const d = digits[i];
    if (!d) return;
    let [a, b] = state.mark;
    if (a === null) return say(`mark a span first: [ at its first frame, ] at its last`, "error");
    if (b === null) b = Math.max(a + 1, state.t + 1);
    try {
      await api("/labels", { method: "POST", body: { episode_ids: [ep.id], key: d.key, value: d.value, start: a, end: b } });
      say(`labelled frames ${a}–${b - 1} ${d.key}=${d.value}`);
      state.mark = [null, null];
      drawMark();
      await refresh();
    } catch (e) {
      sayError(e, "label");
    }
  }

  async function setEpisodeLabel(key, value, note) {
    try {
      const body = { episode_ids: [ep.id], key, value };
      if (note) body.note = note;
      await api("/labels", { method: "POST", body });
      say(`${key} = ${value}`);
      await refresh();
    } catch (e) {
      sayError(e, "label");
      drawLabels();
    }
  }

  async function undo(labelId) {
    try {
      await api(`/labels/${encodeURIComponent(labelId)}/undo`, { method: "POST" });
      const ev = historyOf(state.ep).find((e) => e.id === labelId);
      say(ev ? `undone: ${describe(ev)}` : "undone");
      await refresh();
    } catch (e) {
      sayError(e, "undo");
    }
  }

  function undoLatest() {
    const mine = activeEvents(historyOf(state.ep)).filter((e) => (e.source || "human") === "human" && (!ctx.session || e.author === ctx.session.name));
    if (!mine.length) return say("nothing of yours to undo", "error");
    mine.sort((a, b) => (String(a.created_at) < String(b.created_at) ? -1 : 1));
    undo(mine[mine.length - 1].id);
  }

  async function refresh() {
    state.ep = await api(`/episodes/${encodeURIComponent(id)}`);
    drawLabels();
  }

  function drawLabels() {
    const hist = historyOf(state.ep);
    const cur = currentValues(hist);
    timeline.setSpans(Array.isArray(state.ep.spans) ? state.ep.spans : currentSpans(hist));
    const oc = cur.outcome ? cur.outcome.value : state.ep.outcome || (state.ep.success === true ? "success" : state.ep.success === false ? "failure" : "unknown");
    clear(outcomeBadge, badge(oc, `oc-${oc}`, cur.outcome ? `overridden by ${cur.outcome.author}` : "recorded outcome"));
    const canLabel = ctx.can("labeller");
    const fields = schema.episode.map((k) => {
      const ev = cur[k.key];
      const currentValue = ev ? ev.value : "";
      const who = ev ? h("div.small.muted", `${ev.author} · ${when(ev.created_at)}`) : null;
      let control;
      if (k.free_text || !k.values.length) {
        const ta = h("textarea", { name: k.key, rows: 3, value: currentValue ?? "", "aria-label": k.key });
        control = h("div", ta, h("button", { type: "button", disabled: !canLabel, onclick: () => ta.value.trim() && setEpisodeLabel(k.key, ta.value.trim()) }, `Save ${k.key}`));
      } else {
        const sel = h("select", { name: k.key, "aria-label": k.key, disabled: !canLabel }, h("option", { value: "" }, "—"), k.values.map((v) => h("option", { value: v, selected: v === currentValue }, v)));
        sel.addEventListener("change", () => sel.value && setEpisodeLabel(k.key, sel.value));
        control = sel;
      }
      return h("label.field", { dataset: { key: k.key } }, h("span", k.key, k.shortcut ? h("kbd", k.shortcut) : null), control, who);
    });
    clear(
      labelPanel,
      h("h2", "Labels"),
      canLabel ? null : h("p.muted.small", forbiddenText(null, ctx.session)),
      fields,
    );
    const undone = new Set(hist.filter((e) => e.undoes != null).map((e) => e.undoes));
    const byId = new Map(hist.map((e) => [e.id, e]));
    const items = [...hist].reverse().map((e) => {
      const isUndo = e.undoes != null;
      const span = e.start != null ? ` [${e.start}, ${e.end})` : "";
      return h(
        "li",
        { class: isUndo ? "undo-event" : undone.has(e.id) ? "undone" : "", dataset: { id: e.id } },
        h("div", isUndo ? `undo of ${byId.has(e.undoes) ? describe(byId.get(e.undoes)) : `#${e.undoes}`}` : h("b", `${e.key}=${typeof e.value === "object" ? JSON.stringify(e.value) : e.value}`), isUndo ? null : span, e.note ? h("span.muted", ` “${e.note}”`) : null),
        h("div.small.muted", `${e.author || "?"} · ${e.source || "human"} · ${when(e.created_at)}`),
        !isUndo && !undone.has(e.id) && canLabel ? h("button.link.small", { type: "button", onclick: () => undo(e.id), title: "retract this label" }, "undo") : null,
        e.start != null ? h("button.link.small", { type: "button", onclick: () => player.seek(e.start) }, "go") : null,
      );
    });
    clear(historyPanel, h("h2", "History"), items.length ? h("ol.history-list", items) : h("p.muted", "No labels yet."));
  }

  // --- plots: executed vs proposed action per dimension, reward, state -----------------------
  async function loadSeries() {
    let s;
    try {
      s = await api(`/episodes/${encodeURIComponent(id)}/series`);
    } catch (e) {
      plotSlot.append(h("div.error", `series: ${e.text || e.message}`));
      return;
    }
    const pick = (...names) => {
      for (const n of names) if (s[n] !== undefined && s[n] !== null) return s[n];
      return null;
    };
    const exec = rows(pick("action", "actions", "executed_action", "executed"), length);
    const prop = rows(pick("proposed_action", "proposed", "policy_action", "action_proposed"), length);
    const reward = flat(pick("reward", "rewards"));
    const st = rows(pick("state", "states", "observation.state"), length);
    const seek = (x) => player.seek(x);
    if (reward) timeline.setReward(reward);
    const grid = h("div.dims");
    plotSlot.append(h("h2", "Action: executed (solid) vs proposed (dashed)"), grid);
    const dims = Math.max(exec ? exec[0]?.length || 0 : 0, prop ? prop[0]?.length || 0 : 0);
    for (let d = 0; d < dims; d++) {
      const p = new LinePlot(grid, { title: `a[${d}]`, height: 90, onSeek: seek, legend: false, xMax: length - 1 });
      p.setData({
        series: [
          exec && { name: "executed", values: exec.map((r) => (r ? r[d] : null)), color: "#4e79a7", width: 1.5 },
          prop && { name: "proposed", values: prop.map((r) => (r ? r[d] : null)), color: "#f28e2b", dash: [4, 3] },
        ].filter(Boolean),
      });
      plots.push(p);
    }
    const row = h("div.grid2");
    plotSlot.append(row);
    if (reward) {
      const p = new LinePlot(row, { title: "reward", height: 120, onSeek: seek, legend: false, xMax: length - 1 });
      p.setData({ series: [{ name: "reward", values: reward, color: "#59a14f", width: 1.5 }] });
      plots.push(p);
    }
    const unc = flat(pick("uncertainty"));
    if (unc && unc.some((v) => v !== null)) {
      const p = new LinePlot(row, { title: "policy uncertainty (accel, per chunk)", height: 120, onSeek: seek, legend: false, xMax: length - 1 });
      p.setData({ series: [{ name: "uncertainty", values: unc, color: "#e15759", width: 1.5 }] });
      plots.push(p);
    }
    const fail = flat(pick("failure"));
    if (fail && fail.some((v) => v !== null)) {
      const p = new LinePlot(row, { title: "learned failure score (per chunk)", height: 120, onSeek: seek, legend: false, xMax: length - 1 });
      p.setData({ series: [{ name: "failure", values: fail, color: "#b07aa1", width: 1.5 }] });
      plots.push(p);
    }
    if (st && st[0]) {
      const p = new LinePlot(row, { title: `state (${st[0].length} dims)`, height: 120, onSeek: seek, legend: false, xMax: length - 1 });
      p.setData({ series: st[0].map((_, d) => ({ values: st.map((r) => (r ? r[d] : null)), color: colour(null, d), width: 1 })) });
      plots.push(p);
    }
    for (const p of plots) p.setCursor(state.t);
  }

  // --- keyboard -------------------------------------------------------------------------------
  const onKey = (ev) => {
    if (document.querySelector("dialog[open]")) return;
    if (typing(ev)) {
      if (ev.key === "Escape") ev.target.blur();
      return;
    }
    if ((ev.ctrlKey || ev.metaKey) && ev.key.toLowerCase() === "z") {
      ev.preventDefault();
      return undoLatest();
    }
    if (ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const k = ev.key;
    const big = ev.shiftKey ? Math.round(fps) : 1;
    if (k === " ") player.toggle();
    else if (k === "ArrowRight") player.step(big);
    else if (k === "ArrowLeft") player.step(-big);
    else if (k === "Home") player.seek(0);
    else if (k === "End") player.seek(length - 1);
    else if (k === "[") markStart();
    else if (k === "]") markEnd();
    else if (k === "Escape") {
      state.mark = [null, null];
      drawMark();
    } else if (/^[1-9]$/.test(k)) labelSpan(Number(k) - 1);
    else if (k === "u") undoLatest();
    else {
      const entry = schema.episode.find((e) => e.shortcut && e.shortcut === k);
      if (!entry) return;
      labelPanel.querySelector(`[name="${CSS.escape(entry.key)}"]`)?.focus();
    }
    ev.preventDefault();
  };
  document.addEventListener("keydown", onKey);

  drawLabels();
  drawMark();
  uiReady = true;
  onFrame(player.t);
  loadSeries();
  return () => {
    document.removeEventListener("keydown", onKey);
    player.destroy();
    plots.forEach((p) => p.destroy());
  };
}

/** "key=value [start, end)" of a label event. */
function describe(e) {
  const v = typeof e.value === "object" ? JSON.stringify(e.value) : e.value;
  return `${e.key}=${v}${e.start != null ? ` [${e.start}, ${e.end})` : ""}`;
}

/** Per-frame rows from either frames x dims or {dims: [...]}; null when absent. */
function rows(v, length) {
  if (!v) return null;
  if (!Array.isArray(v) && typeof v === "object") v = v.values || v.data || null;
  if (!Array.isArray(v) || !v.length) return null;
  if (!Array.isArray(v[0]) && v[0] !== null) return v.map((x) => [x]);
  // dims x frames (fewer rows than frames, each as long as the episode): transpose
  if (v.length !== length && Array.isArray(v[0]) && v[0].length === length) return v[0].map((_, t) => v.map((r) => r[t]));
  return v;
}

function flat(v) {
  if (!v) return null;
  if (!Array.isArray(v) && typeof v === "object") v = v.values || v.data || null;
  if (!Array.isArray(v)) return null;
  return v.map((x) => (Array.isArray(x) ? x[0] : x));
}

