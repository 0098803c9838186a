// Synchronised playback of every camera: JPEG frames fetched with the auth header
// (/episodes/{id}/frames/{cam}/{t}.jpg), decoded off the main thread (createImageBitmap), kept in a
// bounded cache and drawn into one canvas per camera. A prefetch window runs ahead of the cursor.
import { blob } from "./api.js";
import { h } from "./util.js";

const MAX_INFLIGHT = 5;
const CACHE_FRAMES = 900; // per camera

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
    this.cache = new Map(opts.cameras.map((c) => [c, new Map()]));
    this.inflight = new Map(); // "cam/t" -> promise
    this.queue = [];
    this.running = new Set(); // jobs being fetched
    this.active = 0;
    this.waiters = [];
    this.firstShown = false;
    this.views = opts.cameras.map((cam) => {
      const canvas = h("canvas", { width: 224, height: 224, "aria-label": `camera ${cam}` });
      const el = h("figure.camera", { dataset: { camera: cam } }, canvas, h("figcaption", cam));
      return { cam, canvas, ctx: canvas.getContext("2d"), shown: -1, el };
    });
    this.status = h("span.player-status.muted");
    parent.append(h("div.cameras", this.views.map((v) => v.el)));
    this.statusEl = this.status;
    window.vlaPlayer = this;
  }

  get length() {
    return this.opts.length;
  }

  frameUrl(cam, t) {
    return `/episodes/${encodeURIComponent(this.opts.episodeId)}/frames/${encodeURIComponent(cam)}/${t}.jpg`;
  }

  /** Fetch (once) and decode frame t of cam; resolves to an ImageBitmap or null on error. */
  load(cam, t) {
    const bm = this.cache.get(cam).get(t);
    if (bm) return Promise.resolve(bm);
    const key = `${cam}/${t}`;
    if (this.inflight.has(key)) return this.inflight.get(key).promise;
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    const job = { cam, t, key, promise, resolve };
    this.inflight.set(key, job);
    this.queue.push(job);
    this.pump();
    return promise;
  }

  pump() {
    while (!this.destroyed && this.active < MAX_INFLIGHT && this.queue.length) {
      // nearest to the cursor first (ahead of it preferred)
      let best = 0;
      let bestD = Infinity;
      for (let i = 0; i < this.queue.length; i++) {
        const dt = this.queue[i].t - this.t;
        const d = dt >= 0 ? dt : -dt * 3;
        if (d < bestD) [best, bestD] = [i, d];
      }
      const job = this.queue.splice(best, 1)[0];
      this.active++;
      job.ac = new AbortController();
      this.running.add(job);
      blob(this.frameUrl(job.cam, job.t), { signal: job.ac.signal })
        .then((b) => createImageBitmap(b))
        .then((bm) => {
          this.store(job.cam, job.t, bm);
          job.resolve(bm);
          this.onLoaded(job.cam, job.t);
        })
        .catch((e) => {
          if (e.name !== "AbortError") this.error = e;
          job.resolve(null);
        })
        .finally(() => {
          this.inflight.delete(job.key);
          this.running.delete(job);
          this.active--;
          this.pump();
        });
    }
  }

  store(cam, t, bm) {
    const c = this.cache.get(cam);
    c.set(t, bm);
    if (c.size > CACHE_FRAMES) {
      // evict the frame farthest from the cursor
      let far = null;
      let farD = -1;
      for (const k of c.keys()) {
        const d = Math.abs(k - this.t);
        if (d > farD) [far, farD] = [k, d];
      }
      c.get(far).close?.();
      c.delete(far);
    }
  }

  onLoaded(cam, t) {
    if (t === this.t) this.drawAll();
  }

  /** A jump: stop fetching frames far from the new cursor, so its own frames get the connections. */
  cancelFar() {
    const ahead = Math.ceil(this.opts.fps * 2);
    for (const job of this.running) if (job.t < this.t - 8 || job.t > this.t + ahead) job.ac.abort();
  }

  /** Prefetch around the cursor: a few frames behind, 2 s ahead while playing (1 s paused). */
  prefetch() {
    const ahead = Math.ceil(this.opts.fps * (this.playing ? 2 : 1));
    // drop queued jobs far outside the window (scrubbing leaves many behind)
    this.queue = this.queue.filter((j) => {
      const keep = j.t >= this.t - 8 && j.t <= this.t + ahead * 2;
      if (!keep) {
        this.inflight.delete(j.key);
        j.resolve(null);
      }
      return keep;
    });
    for (let d = 0; d <= ahead; d++) {
      for (const dir of d < 4 ? [1, -1] : [1]) {
        const t = this.t + dir * d;
        if (t < 0 || t >= this.length) continue;
        for (const v of this.views) if (!this.cache.get(v.cam).has(t)) this.load(v.cam, t);
      }
    }
  }

  /** Draw frame t in every camera (the nearest cached earlier frame where t is not loaded yet). */
  drawAll() {
    let exact = true;
    for (const v of this.views) {
      const c = this.cache.get(v.cam);
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
      const ws = this.waiters;
      this.waiters = [];
      ws.forEach((w) => w.t === this.t && w.resolve(performance.now()));
      this.waiters.push(...ws.filter((w) => w.t !== this.t));
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
    this.views.forEach((v) => this.load(v.cam, t));
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
      // advance only over frames that are loaded for every camera (buffering otherwise)
      while (acc >= 1) {
        const next = this.t + 1;
        if (next >= this.length) {
          this.pause();
          return;
        }
        if (!this.views.every((v) => this.cache.get(v.cam).has(next))) {
          acc = Math.min(acc, 1);
          this.statusEl.textContent = "buffering…";
          this.prefetch();
          break;
        }
        acc -= 1;
        this.statusEl.textContent = "";
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
    this.statusEl.textContent = "";
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
    for (const c of this.cache.values()) for (const bm of c.values()) bm.close?.();
    if (window.vlaPlayer === this) window.vlaPlayer = null;
  }
}
