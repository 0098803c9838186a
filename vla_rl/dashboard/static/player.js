// Synchronised playback of every camera: JPEG frames fetched with the auth header
// (/episodes/{id}/frames/{cam}/{t}.jpg) into canvases, one per camera.
//
// Two caches: the JPEG bytes (small, ~10 KB a frame at 224 px, kept for the whole episode up to a
// byte budget) and decoded ImageBitmaps (large, kept only around the cursor). The frames near the
// cursor are fetched first (a prefetch window ahead of it); when those are in, the rest of the episode
// is buffered in the background, two requests at a time, like a video player does, so that once it is
// buffered a seek anywhere is a local decode. A jump aborts the fetches far from the new cursor.
import { blob } from "./api.js";
import { h } from "./util.js";

const MAX_INFLIGHT = 5; // foreground requests (the browser allows 6 per host)
const BACKGROUND_INFLIGHT = 2;
const BITMAPS_PER_CAMERA = 160;
const JPEG_BUDGET_BYTES = 256 * 2 ** 20;

export class Player {
  /**
   * @param {HTMLElement} parent
   * @param {{episodeId: string, cameras: string[], length: number, fps: number,
   *          onFrame?: (t: number) => void, onState?: (playing: boolean) => void}} opts
   */
  constructor(parent, opts) {
    this.opts = opts;
    this.t = 0;
    this.playing = false;
    this.jpegs = new Map(opts.cameras.map((c) => [c, new Map()]));
    this.bitmaps = new Map(opts.cameras.map((c) => [c, new Map()]));
    this.jpegBytes = 0;
    this.fetching = new Map(); // "cam/t" -> job being fetched or queued
    this.queue = [];
    this.running = new Set();
    this.decoding = new Map(); // "cam/t" -> promise of a bitmap
    this.waiters = [];
    this.firstShown = false;
    this.buffered = 0; // frames whose JPEG is held for every camera
    this.fillFrom = 0;
    this.views = opts.cameras.map((cam) => {
      const canvas = h("canvas", { width: 224, height: 224, "aria-label": `camera ${cam}` });
      const el = h("figure.camera", { dataset: { camera: cam } }, canvas, h("figcaption", cam));
      return { cam, canvas, ctx: canvas.getContext("2d"), shown: -1, el };
    });
    this.status = h("span.player-status.muted");
    this.bufferOut = h("span.buffered.muted.small");
    parent.append(h("div.cameras", this.views.map((v) => v.el)));
    window.vlaPlayer = this;
  }

  get length() {
    return this.opts.length;
  }

  frameUrl(cam, t) {
    return `/episodes/${encodeURIComponent(this.opts.episodeId)}/frames/${encodeURIComponent(cam)}/${t}.jpg`;
  }

  hasAll(t, cache = this.bitmaps) {
    return this.views.every((v) => cache.get(v.cam).has(t));
  }

  // ---------------------------------------------------------------- fetching JPEGs
  /** Resolves when frame t of cam is held as JPEG (fetched once), or null if it could not be. */
  fetchJpeg(cam, t, background = false) {
    const have = this.jpegs.get(cam).get(t);
    if (have) return Promise.resolve(have);
    const key = `${cam}/${t}`;
    const known = this.fetching.get(key);
    if (known) {
      if (!background) known.background = false;
      return known.promise;
    }
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    const job = { cam, t, key, promise, resolve, background };
    this.fetching.set(key, job);
    this.queue.push(job);
    this.pump();
    return promise;
  }

  pump() {
    for (;;) {
      if (this.destroyed) return;
      const fg = this.queue.filter((j) => !j.background);
      let job = null;
      if (fg.length && this.running.size < MAX_INFLIGHT) {
        // nearest to the cursor first (ahead of it preferred)
        const d = (j) => (j.t >= this.t ? j.t - this.t : (this.t - j.t) * 3);
        job = fg.reduce((a, b) => (d(b) < d(a) ? b : a));
      } else if (!fg.length && [...this.running].filter((j) => j.background).length < BACKGROUND_INFLIGHT && this.running.size < MAX_INFLIGHT) {
        job = this.queue.find((j) => j.background) || this.nextFill();
      }
      if (!job) return;
      this.queue = this.queue.filter((j) => j !== job);
      this.start(job);
    }
  }

  start(job) {
    job.ac = new AbortController();
    this.running.add(job);
    blob(this.frameUrl(job.cam, job.t), { signal: job.ac.signal })
      .then((b) => {
        this.keepJpeg(job.cam, job.t, b);
        job.resolve(b);
      })
      .catch((e) => {
        if (e.name !== "AbortError") this.error = e;
        job.resolve(null);
      })
      .finally(() => {
        this.fetching.delete(job.key);
        this.running.delete(job);
        this.pump();
      });
  }

  /** The next frame to buffer in the background: scanning forward from the cursor, wrapping. */
  nextFill() {
    if (this.buffered >= this.length || this.jpegBytes > JPEG_BUDGET_BYTES) return null;
    for (let i = 0; i < this.length; i++) {
      const t = (Math.max(this.fillFrom, this.t) + i) % this.length;
      for (const v of this.views) {
        const key = `${v.cam}/${t}`;
        if (!this.jpegs.get(v.cam).has(t) && !this.fetching.has(key)) {
          this.fillFrom = t;
          let resolve;
          const promise = new Promise((r) => (resolve = r));
          const job = { cam: v.cam, t, key, promise, resolve, background: true };
          this.fetching.set(key, job);
          return job;
        }
      }
    }
    return null;
  }

  keepJpeg(cam, t, b) {
    const m = this.jpegs.get(cam);
    if (m.has(t)) return;
    m.set(t, b);
    this.jpegBytes += b.size;
    if (this.hasAll(t, this.jpegs)) this.buffered++;
    this.bufferOut.textContent = this.buffered < this.length ? `buffered ${Math.floor((100 * this.buffered) / this.length)}%` : "";
    while (this.jpegBytes > JPEG_BUDGET_BYTES) this.evictJpeg();
    if (t === this.t || (t > this.t && t < this.t + this.opts.fps * 2)) this.decode(cam, t);
  }

  evictJpeg() {
    let far = null;
    for (const v of this.views)
      for (const k of this.jpegs.get(v.cam).keys()) if (!far || Math.abs(k - this.t) > Math.abs(far[1] - this.t)) far = [v.cam, k];
    if (!far) return;
    if (this.hasAll(far[1], this.jpegs)) this.buffered--;
    this.jpegBytes -= this.jpegs.get(far[0]).get(far[1]).size;
    this.jpegs.get(far[0]).delete(far[1]);
  }

  // ---------------------------------------------------------------- decoding
  /** Resolves to the ImageBitmap of frame t of cam (fetching its JPEG first if needed). */
  decode(cam, t) {
    const bm = this.bitmaps.get(cam).get(t);
    if (bm) return Promise.resolve(bm);
    const key = `${cam}/${t}`;
    if (this.decoding.has(key)) return this.decoding.get(key);
    const p = this.fetchJpeg(cam, t)
      .then((b) => (b ? createImageBitmap(b) : null))
      .then((bm2) => {
        if (bm2) {
          this.keepBitmap(cam, t, bm2);
          if (t === this.t) this.drawAll();
        }
        return bm2;
      })
      .catch(() => null)
      .finally(() => this.decoding.delete(key));
    this.decoding.set(key, p);
    return p;
  }

  keepBitmap(cam, t, bm) {
    const c = this.bitmaps.get(cam);
    c.set(t, bm);
    if (c.size <= BITMAPS_PER_CAMERA) return;
    let far = null;
    for (const k of c.keys()) if (far === null || Math.abs(k - this.t) > Math.abs(far - this.t)) far = k;
    c.get(far).close?.();
    c.delete(far);
  }

  /** Decode the window around the cursor: a few frames behind, 2 s ahead while playing (1 s paused). */
  prefetch() {
    const ahead = Math.ceil(this.opts.fps * (this.playing ? 2 : 1));
    for (let d = 0; d <= ahead; d++)
      for (const dir of d < 4 ? [1, -1] : [1]) {
        const t = this.t + dir * d;
        if (t < 0 || t >= this.length) continue;
        for (const v of this.views) if (!this.bitmaps.get(v.cam).has(t)) this.decode(v.cam, t);
      }
  }

  /** A jump: abort the fetches far from the new cursor so that its own frames get the connections. */
  cancelFar() {
    const ahead = Math.ceil(this.opts.fps * 2);
    for (const job of this.running) if (job.t < this.t - 8 || job.t > this.t + ahead) job.ac.abort();
    this.queue = this.queue.filter((j) => {
      const keep = j.t >= this.t - 8 && j.t <= this.t + ahead;
      if (!keep) {
        this.fetching.delete(j.key);
        j.resolve(null);
      }
      return keep;
    });
  }

  // ---------------------------------------------------------------- drawing
  /** Draw frame t in every camera (the nearest decoded earlier frame where t is not decoded yet). */
  drawAll() {
    let exact = true;
    for (const v of this.views) {
      const c = this.bitmaps.get(v.cam);
      let bm = c.get(this.t);
      if (!bm) {
        exact = false;
        for (let k = this.t - 1; k >= Math.max(0, this.t - 30) && !bm; k--) bm = c.get(k);
        if (!bm || v.shown === this.t) continue;
      }
      if (v.canvas.width !== bm.width || v.canvas.height !== bm.height) {
        v.canvas.width = bm.width;
        v.canvas.height = bm.height;
      }
      v.ctx.drawImage(bm, 0, 0);
      v.shown = c.has(this.t) ? this.t : -1;
    }
    this.views.forEach((v) => v.el.classList.toggle("stale", v.shown !== this.t));
    if (exact) {
      if (!this.firstShown) {
        this.firstShown = true;
        performance.mark("vla:first-frame");
      }
      const now = performance.now();
      this.waiters = this.waiters.filter((w) => (w.t === this.t ? (w.resolve(now), false) : true));
    }
    return exact;
  }

  /** Move the cursor to frame t; resolves (performance.now()) once every camera shows frame t. */
  seek(t, { fromPlayback = false } = {}) {
    t = Math.max(0, Math.min(this.length - 1, Math.round(t)));
    if (!fromPlayback && this.playing) this.pause();
    const jump = Math.abs(t - this.t) > 8;
    this.t = t;
    if (jump) this.cancelFar();
    const shown = new Promise((resolve) => this.waiters.push({ t, resolve }));
    this.views.forEach((v) => this.decode(v.cam, t));
    this.drawAll();
    this.prefetch();
    if (this.opts.onFrame) this.opts.onFrame(t);
    return shown;
  }

  /** Seek and return how long (ms) it took until frame t was on screen. */
  async timedSeek(t) {
    const t0 = performance.now();
    const t1 = await this.seek(t);
    return t1 - t0;
  }

  step(df) {
    return this.seek(this.t + df);
  }

  play() {
    if (this.playing) return;
    if (this.t >= this.length - 1) this.seek(0);
    this.playing = true;
    this.opts.onState?.(true);
    this.prefetch();
    let last = performance.now();
    let acc = 0;
    const tick = (now) => {
      if (!this.playing) return;
      acc += ((now - last) / 1000) * this.opts.fps;
      last = now;
      // advance only over frames decoded for every camera (buffering otherwise)
      while (acc >= 1) {
        const next = this.t + 1;
        if (next >= this.length) {
          this.pause();
          return;
        }
        if (!this.hasAll(next)) {
          acc = Math.min(acc, 1);
          this.status.textContent = "buffering…";
          this.prefetch();
          break;
        }
        acc -= 1;
        this.status.textContent = "";
        this.seek(next, { fromPlayback: true });
      }
      this.raf = requestAnimationFrame(tick);
    };
    this.raf = requestAnimationFrame(tick);
  }

  pause() {
    if (!this.playing) return;
    this.playing = false;
    cancelAnimationFrame(this.raf);
    this.status.textContent = "";
    this.opts.onState?.(false);
  }

  toggle() {
    if (this.playing) this.pause();
    else this.play();
  }

  destroy() {
    this.pause();
    this.destroyed = true;
    this.queue = [];
    for (const job of this.running) job.ac.abort();
    for (const c of this.bitmaps.values()) for (const bm of c.values()) bm.close?.();
    if (window.vlaPlayer === this) window.vlaPlayer = null;
  }
}
