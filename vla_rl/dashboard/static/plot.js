// Canvas line plots. The data layer is drawn once per resize/data change; the shared cursor is a
// positioned element on top, so moving it (playback, scrubbing) costs no redraw.
import { h } from "./util.js";

const PAD = { l: 44, r: 8, t: 16, b: 18 };

export class LinePlot {
  /**
   * @param {HTMLElement} parent
   * @param {{title?: string, height?: number, time?: boolean, yMin?: number, yMax?: number,
   *          onSeek?: (x: number) => void, legend?: boolean}} opts
   */
  constructor(parent, opts = {}) {
    this.opts = { height: 120, legend: true, ...opts };
    this.canvas = h("canvas");
    this.cursor = h("div.cursor", { hidden: true });
    this.legend = h("div.legend");
    this.el = h("figure.plot", { style: { height: `${this.opts.height}px` } }, this.canvas, this.cursor);
    parent.append(h("div.plot-wrap", this.opts.title ? h("div.plot-title", this.opts.title) : null, this.el, this.opts.legend ? this.legend : null));
    this.data = { x: null, series: [] };
    this.cursorX = null;
    this.ro = new ResizeObserver(() => this.draw());
    this.ro.observe(this.el);
    if (this.opts.onSeek) this._seekable();
  }

  _seekable() {
    const seek = (ev) => {
      const r = this.el.getBoundingClientRect();
      const x = this.invX(ev.clientX - r.left);
      if (x !== null) this.opts.onSeek(x);
    };
    this.el.addEventListener("pointerdown", (ev) => {
      this.el.setPointerCapture(ev.pointerId);
      seek(ev);
      const move = (e) => seek(e);
      this.el.addEventListener("pointermove", move);
      this.el.addEventListener("pointerup", () => this.el.removeEventListener("pointermove", move), { once: true });
    });
    this.el.style.cursor = "crosshair";
  }

  /** series: [{name, values: number[] (null = gap), color, dash?: number[], width?: number}] */
  setData({ x = null, series }) {
    this.data = { x, series };
    let n = 0;
    for (const s of series) n = Math.max(n, s.values.length);
    this.n = n;
    this.x = x || Array.from({ length: n }, (_, i) => i);
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of series)
      for (const v of s.values) {
        if (v === null || v === undefined || Number.isNaN(v)) continue;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    if (this.opts.yMin !== undefined) lo = this.opts.yMin;
    if (this.opts.yMax !== undefined) hi = this.opts.yMax;
    if (!Number.isFinite(lo)) [lo, hi] = [0, 1];
    if (hi - lo < 1e-9) [lo, hi] = [lo - 0.5, hi + 0.5];
    this.y0 = lo;
    this.y1 = hi;
    this.x0 = this.x.length ? this.x[0] : 0;
    this.x1 = this.x.length > 1 ? this.x[this.x.length - 1] : this.x0 + 1;
    if (this.opts.xMax !== undefined) this.x1 = this.opts.xMax;
    if (this.opts.time && this.x1 - this.x0 < 600) {
      // one point (or a few close together): show the half hour around them
      const mid = (this.x0 + this.x1) / 2;
      [this.x0, this.x1] = [mid - 900, mid + 900];
    }
    this.legend.replaceChildren(
      ...series.filter((s) => s.name).map((s) => h("span", h("i", { style: { background: s.color } }), s.name)),
    );
    this.draw();
  }

  px(x) {
    const w = this.el.clientWidth - PAD.l - PAD.r;
    return PAD.l + ((x - this.x0) / (this.x1 - this.x0 || 1)) * w;
  }

  py(y) {
    const hgt = this.el.clientHeight - PAD.t - PAD.b;
    return PAD.t + (1 - (y - this.y0) / (this.y1 - this.y0)) * hgt;
  }

  invX(px) {
    if (!this.x) return null;
    const w = this.el.clientWidth - PAD.l - PAD.r;
    const f = Math.min(1, Math.max(0, (px - PAD.l) / (w || 1)));
    return this.x0 + f * (this.x1 - this.x0);
  }

  draw() {
    const dpr = window.devicePixelRatio || 1;
    const W = this.el.clientWidth;
    const H = this.el.clientHeight;
    if (!W || !H) return;
    this.canvas.width = Math.round(W * dpr);
    this.canvas.height = Math.round(H * dpr);
    this.canvas.style.width = `${W}px`;
    this.canvas.style.height = `${H}px`;
    const c = this.canvas.getContext("2d");
    c.setTransform(dpr, 0, 0, dpr, 0, 0);
    c.clearRect(0, 0, W, H);
    if (!this.x) return;
    // axes and ticks
    c.strokeStyle = "#d0d4da";
    c.fillStyle = "#6b7280";
    c.font = "10px system-ui, sans-serif";
    c.lineWidth = 1;
    c.beginPath();
    c.moveTo(PAD.l, PAD.t);
    c.lineTo(PAD.l, H - PAD.b);
    c.lineTo(W - PAD.r, H - PAD.b);
    c.stroke();
    c.textAlign = "right";
    c.textBaseline = "middle";
    for (const y of [this.y0, (this.y0 + this.y1) / 2, this.y1]) {
      c.fillText(fmtY(y), PAD.l - 4, this.py(y));
      c.strokeStyle = "#eef0f3";
      c.beginPath();
      c.moveTo(PAD.l + 1, this.py(y));
      c.lineTo(W - PAD.r, this.py(y));
      c.stroke();
    }
    c.textAlign = "center";
    c.textBaseline = "top";
    const span = this.x1 - this.x0;
    const xs = [];
    if (!this.opts.time && span < 5) for (let x = Math.ceil(this.x0); x <= this.x1; x++) xs.push(x);
    else for (let i = 0; i <= 5; i++) xs.push(this.x0 + (span * i) / 5);
    for (const x of xs) {
      c.fillText(this.opts.time ? fmtTime(x, this.x1 - this.x0) : fmtX(x), Math.min(W - 16, Math.max(PAD.l + 8, this.px(x))), H - PAD.b + 3);
    }
    // series
    for (const s of this.data.series) {
      c.strokeStyle = s.color || "#4e79a7";
      c.lineWidth = s.width || 1.25;
      c.setLineDash(s.dash || []);
      c.beginPath();
      let pen = false;
      const vals = s.values;
      const xs = s.x || this.x;
      for (let i = 0; i < vals.length; i++) {
        const v = vals[i];
        if (v === null || v === undefined || Number.isNaN(v)) {
          pen = false;
          continue;
        }
        const X = this.px(xs[i]);
        const Y = this.py(v);
        if (pen) c.lineTo(X, Y);
        else c.moveTo(X, Y);
        pen = true;
      }
      c.stroke();
      if (s.points) {
        c.fillStyle = s.color;
        for (let i = 0; i < vals.length; i++) if (vals[i] !== null && vals[i] !== undefined) c.fillRect(this.px(xs[i]) - 2, this.py(vals[i]) - 2, 4, 4);
        c.fillStyle = "#6b7280";
      }
    }
    c.setLineDash([]);
    this.setCursor(this.cursorX);
  }

  setCursor(x) {
    this.cursorX = x;
    if (x === null || x === undefined || !this.x) {
      this.cursor.hidden = true;
      return;
    }
    this.cursor.hidden = false;
    this.cursor.style.transform = `translateX(${this.px(x)}px)`;
  }

  destroy() {
    this.ro.disconnect();
  }
}

function fmtY(y) {
  const a = Math.abs(y);
  if (a >= 1000) return y.toFixed(0);
  if (a >= 10) return y.toFixed(1);
  return y.toFixed(2);
}

function fmtX(x) {
  return Number.isInteger(x) ? String(x) : x.toFixed(0);
}

function fmtTime(t, span) {
  const d = new Date(t * 1000);
  const iso = d.toISOString();
  return span > 2 * 86400 ? iso.slice(5, 10) : iso.slice(11, 16);
}
