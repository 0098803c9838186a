// The episode timeline: lanes for who was in control (policy / human / scripted, with the takeover
// reason as tooltip), span labels and reward, the marked span and the cursor. SVG in percent
// coordinates, so it needs no redraw on resize; click or drag to scrub.
import { colour, h } from "./util.js";

const LANE_H = 18;
const LANES = ["control", "labels", "reward"];

/** Which controller a segment is: policy | human | scripted. */
export function controllerOf(seg) {
  const c = seg.controller ?? seg.kind ?? seg.type ?? seg.source ?? "";
  if (typeof c === "number") return ["policy", "human", "scripted"][c] || "policy";
  const k = String(c).toLowerCase();
  if (["human", "intervention", "teleop", "operator"].includes(k)) return "human";
  if (["scripted", "reset", "script", "expert"].includes(k)) return "scripted";
  return "policy";
}

export const SPAN_COLOURS = {
  progress: "#59a14f",
  idle: "#bab0ac",
  "failure-inducing": "#e15759",
  recovery: "#76b7b2",
};

export class Timeline {
  /**
   * @param {HTMLElement} parent
   * @param {{length: number, fps: number, onSeek: (t: number) => void}} opts
   */
  constructor(parent, opts) {
    this.opts = opts;
    const height = LANES.length * (LANE_H + 4) + 14;
    this.svg = h("svg.timeline", { height, width: "100%", role: "slider", "aria-label": "timeline", tabindex: "-1" });
    this.lanes = {};
    LANES.forEach((name, i) => {
      const g = h("g", { class: `lane lane-${name}`, dataset: { lane: name } });
      g.setAttribute("transform", `translate(0 ${i * (LANE_H + 4)})`);
      this.lanes[name] = g;
      this.svg.append(g);
    });
    this.markRect = h("rect.mark", { y: 0, height: LANES.length * (LANE_H + 4), x: "0%", width: "0%", visibility: "hidden" });
    this.cursor = h("line.cursor", { x1: "0%", x2: "0%", y1: 0, y2: height - 12 });
    this.ticks = h("g.ticks");
    this.ticks.setAttribute("transform", `translate(0 ${LANES.length * (LANE_H + 4) + 10})`);
    this.svg.append(this.markRect, this.ticks, this.cursor);
    const labels = h("div.lane-names", LANES.map((n) => h("div", n)));
    this.el = h("div.timeline-wrap", labels, this.svg);
    parent.append(this.el);
    this._ticks();
    this._scrub();
  }

  pct(t) {
    return `${(100 * t) / Math.max(1, this.opts.length)}%`;
  }

  _ticks() {
    const { length, fps } = this.opts;
    const secs = length / fps;
    if (secs < 3) {
      // short episodes: ticks in frames
      const step = [1, 2, 5, 10, 20, 50].find((s) => length / s <= 12) || 100;
      for (let f = 0; f < length; f += step) {
        const x = this.pct(f + 0.5);
        this.ticks.append(h("line", { x1: x, x2: x, y1: -6, y2: -2 }), h("text", { x, y: 2 }, `${f}`));
      }
      return;
    }
    const step = [1, 2, 5, 10, 15, 30, 60, 120, 300].find((s) => secs / s <= 12) || 600;
    for (let s = 0; s <= secs; s += step) {
      const x = this.pct(s * fps);
      this.ticks.append(h("line", { x1: x, x2: x, y1: -6, y2: -2 }), h("text", { x, y: 2 }, `${s}s`));
    }
  }

  _scrub() {
    const at = (ev) => {
      const r = this.svg.getBoundingClientRect();
      const f = Math.min(1, Math.max(0, (ev.clientX - r.left) / r.width));
      this.opts.onSeek(Math.min(this.opts.length - 1, Math.floor(f * this.opts.length)));
    };
    this.svg.addEventListener("pointerdown", (ev) => {
      this.svg.setPointerCapture(ev.pointerId);
      at(ev);
      const move = (e) => at(e);
      this.svg.addEventListener("pointermove", move);
      this.svg.addEventListener("pointerup", () => this.svg.removeEventListener("pointermove", move), { once: true });
    });
  }

  rect(lane, start, end, fill, title, cls = "", text = "") {
    const g = h("g", { class: `span ${cls}` });
    g.append(
      h("rect", { x: this.pct(start), width: this.pct(Math.max(0.5, end - start)), y: 1, height: LANE_H - 2, fill, rx: 2 }),
      h("title", title),
    );
    if (text) g.append(h("text", { x: this.pct(start), dx: 3, y: LANE_H - 5 }, text));
    this.lanes[lane].append(g);
    return g;
  }

  /** segments: [{start, end, controller|kind, reason?}] */
  setSegments(segments) {
    this.lanes.control.replaceChildren();
    for (const s of segments || []) {
      const who = controllerOf(s);
      const end = s.end ?? this.opts.length;
      let reason = s.reason ?? s.takeover_reason ?? s.trigger ?? "";
      if (who === "policy" && reason === "policy") reason = "";
      const what = who === "human" ? "takeover" : s.kind === "reset" ? "reset" : "";
      const title = `${who} frames ${s.start}–${end - 1}${reason ? ` · ${what || "reason"}: ${reason}` : ""}`;
      const g = this.rect("control", s.start, end, `var(--${who})`, title, `ctl-${who}`);
      g.dataset.controller = who;
      if (reason) g.dataset.reason = reason;
    }
  }

  /** spans: label events with start/end (current ones). */
  setSpans(spans) {
    this.lanes.labels.replaceChildren();
    for (const s of spans || []) {
      const fill = SPAN_COLOURS[s.value] || colour(s.value);
      const g = this.rect("labels", s.start, s.end, fill, `${s.key}=${s.value} ${s.start}–${s.end} · ${s.author || ""} (${s.source || "human"})`, "label-span", String(s.value));
      g.dataset.value = s.value;
      g.dataset.start = s.start;
      g.dataset.end = s.end;
    }
  }

  /** reward: number[] per frame, drawn as bars (positive up, negative down). */
  setReward(reward) {
    const lane = this.lanes.reward;
    lane.replaceChildren();
    if (!reward || !reward.length) return;
    let max = 0;
    for (const r of reward) if (r !== null && Math.abs(r) > max) max = Math.abs(r);
    if (max === 0) {
      lane.append(h("line", { x1: "0%", x2: "100%", y1: LANE_H / 2, y2: LANE_H / 2, class: "zero" }));
      return;
    }
    // one path in a 0..length x 0..LANE_H box, stretched horizontally
    const inner = h("svg", { x: 0, y: 0, width: "100%", height: LANE_H, viewBox: `0 0 ${reward.length} ${LANE_H}`, preserveAspectRatio: "none" });
    let d = "";
    const mid = LANE_H / 2;
    reward.forEach((r, i) => {
      if (!r) return;
      const hgt = (Math.abs(r) / max) * (mid - 1);
      d += `M${i} ${r > 0 ? mid - hgt : mid}h1v${hgt}h-1z`;
    });
    inner.append(h("path", { d, class: "reward" }), h("title", `reward (max |r| ${max.toFixed(3)})`));
    lane.append(inner);
  }

  setMark(start, end) {
    if (start === null || start === undefined) {
      this.markRect.setAttribute("visibility", "hidden");
      return;
    }
    const e = end ?? start + 1;
    const [a, b] = e > start ? [start, e] : [e, start + 1];
    this.markRect.setAttribute("x", this.pct(a));
    this.markRect.setAttribute("width", this.pct(b - a));
    this.markRect.setAttribute("visibility", "visible");
  }

  setCursor(t) {
    const x = this.pct(t + 0.5);
    this.cursor.setAttribute("x1", x);
    this.cursor.setAttribute("x2", x);
    this.svg.setAttribute("aria-valuenow", t);
  }
}
