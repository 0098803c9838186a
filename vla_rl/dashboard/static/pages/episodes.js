// Episodes: server-side filters mirrored in the URL, sort, paging, multi-select and bulk labels
// from the schema, a "flagged" view and flag badges.
import { api, queryString } from "../api.js";
import { forbiddenText, normaliseSchema } from "../labels.js";
import { navigate, setQuery } from "../router.js";
import { badgeHtml, clear, esc, h, num, short, showError, thousands, typing, when } from "../util.js";

const FILTERS = [
  ["task", "task", "text"],
  ["robot", "robot", "text"],
  ["outcome", "outcome", "select", ["", "success", "failure", "unknown"]],
  ["revision", "revision", "text"],
  ["round", "round", "number"],
  ["label", "label key:value", "text"],
  ["intervention", "intervention", "select", ["", "true", "false"]],
  ["flag", "flag", "text"],
  ["status", "status", "select", ["", "closed", "open"]],
  ["since", "since", "date"],
  ["until", "until", "date"],
  ["min_length", "min length", "number"],
  ["max_length", "max length", "number"],
];
const SORTS = { created_at: "created", length: "length", robot_id: "robot", task: "task" };
const REPEATED = new Set(["label", "flag"]);
/** The filters and the rest of the page are put on screen with the first rows, in one frame (one
 * style and layout pass instead of two), or after this long if the list is slow to come (a page may set
 * ``window.vlaSkeletonWaitMs`` before it loads: the browser tests do, so a loaded CI machine cannot
 * decide which of the two paths they see). */
const SKELETON_WAIT_MS = Number.isFinite(window.vlaSkeletonWaitMs) ? window.vlaSkeletonWaitMs : 300;

export async function render(root, ctx) {
  let query = new URLSearchParams(location.search);
  const flaggedView = query.get("flagged") === "true";
  const err = h("div.err-slot");
  const form = h("form.filters", { onsubmit: (ev) => ev.preventDefault() });
  const summary = h("div.summary");
  const syncNote = h("span.sync-note", { role: "status" });
  const table = h("div.table-wrap");
  const pager = h("div.pager");
  const bulk = h("div.bulk");
  const bulkMsg = h("div.bulk-msg", { role: "status" });
  const parts = [
    h("h1", flaggedView ? "Flagged episodes" : "Episodes"),
    form,
    err,
    h("div.toolbar", summary, syncNote, h("span.spacer"), bulk),
    bulkMsg,
    table,
    pager,
  ];
  let shown = false;
  const show = () => {
    if (shown) return;
    shown = true;
    clearTimeout(showTimer);
    root.append(...parts);
  };
  const showTimer = setTimeout(show, SKELETON_WAIT_MS);

  const inputs = {};
  for (const [name, label, type, options] of FILTERS) {
    const value = REPEATED.has(name) ? query.getAll(name).join(" ") : query.get(name) || "";
    let input;
    if (type === "select") input = h("select", { name }, options.map((o) => h("option", { value: o, selected: o === value }, o || "any")));
    else input = h("input", { name, type, value, placeholder: REPEATED.has(name) ? "space-separated" : "", size: type === "number" ? 6 : 12 });
    inputs[name] = input;
    form.append(h("label", h("span", label), input));
  }
  const flagged = h("input", { type: "checkbox", name: "flagged", checked: flaggedView });
  const perPage = h("select", { name: "per_page" }, [25, 50, 100, 200, 500].map((n) => h("option", { value: n, selected: String(n) === (query.get("per_page") || "50") }, n)));
  form.append(h("label.check", flagged, h("span", "flagged only")), h("label", h("span", "per page"), perPage));
  const reset = h("button", { type: "button", onclick: () => navigate("/episodes") }, "Clear");
  const toRound = h("a.button", { href: "#" }, "Train a round on this selection");
  form.append(reset, toRound);

  const state = { total: 0, items: [], selected: new Set(), all: false, cursor: 0, loading: null };

  const readForm = () => {
    const q = new URLSearchParams();
    for (const [name] of FILTERS) {
      const v = inputs[name].value.trim();
      if (!v) continue;
      if (REPEATED.has(name)) v.split(/\s+/).forEach((x) => q.append(name, x));
      else q.set(name, v);
    }
    if (flagged.checked) q.set("flagged", "true");
    if (perPage.value !== "50") q.set("per_page", perPage.value);
    const sort = query.get("sort");
    if (sort) q.set("sort", sort);
    return q;
  };

  const filterOnly = (q) => {
    const f = new URLSearchParams(q);
    ["page", "per_page", "sort"].forEach((k) => f.delete(k));
    return f;
  };

  const load = async () => {
    state.loading?.abort();
    const ac = new AbortController();
    state.loading = ac;
    const t0 = performance.now();
    try {
      const res = await api(`/episodes${queryString(query)}`, { signal: ac.signal });
      performance.mark("vla:episodes-received");
      state.total = res.total;
      state.items = res.items || [];
      state.page = res.page || 1;
      state.perPage = res.per_page || 50;
      drawSync(res.sync);
      state.cursor = Math.min(state.cursor, Math.max(0, state.items.length - 1));
      showError(err, null);
      drawTable();
      drawPager();
      show();
      performance.mark("vla:episodes-in-dom"); // the rows are built; the browser lays them out and paints next
      sessionStorage.setItem("vla:last-episodes", location.pathname + location.search);
      toRound.href = `/rounds?new=1&filter=${encodeURIComponent(filterOnly(query).toString())}`;
      requestAnimationFrame(() => {
        performance.mark("vla:episodes-rendered");
        window.vlaEpisodesRendered = { ms: performance.now() - t0, at: performance.now(), total: state.total, sync: res.sync?.phase };
        // a task posted in the frame runs once the frame's style, layout and paint are done
        const ch = new MessageChannel();
        ch.port1.onmessage = () => performance.mark("vla:episodes-painted");
        ch.port2.postMessage(null);
      });
      await ctx.ready; // the bulk-label bar needs the schema and the role
      drawBulk();
    } catch (e) {
      if (e.name === "AbortError") return;
      showError(err, e, "episodes");
      clear(table);
      show();
    }
  };

  const apply = ({ keepPage = false, push = true } = {}) => {
    const q = readForm();
    if (keepPage && query.get("page")) q.set("page", query.get("page"));
    query = q;
    state.selected.clear();
    state.all = false;
    setQuery(q, { replace: !push });
    load();
  };
  form.addEventListener("change", () => apply());
  form.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") {
      ev.preventDefault();
      apply();
    }
  });

  const sortBy = (key) => {
    const cur = query.get("sort") || "-created_at";
    const next = cur === key ? `-${key}` : cur === `-${key}` ? key : key === "created_at" ? "-created_at" : key;
    query.set("sort", next);
    query.delete("page");
    setQuery(query, { replace: false });
    load();
  };

  const goPage = (p) => {
    const last = Math.max(1, Math.ceil(state.total / state.perPage));
    p = Math.max(1, Math.min(last, p));
    if (p === state.page) return;
    if (p === 1) query.delete("page");
    else query.set("page", p);
    setQuery(query, { replace: false });
    load();
  };

  // the table is one HTML string (every value escaped) and its events are handled on its wrapper:
  // building 50 rows element by element was most of the script time between the list's arrival and
  // its rows on screen
  function drawTable() {
    const sort = query.get("sort") || "-created_at";
    const th = (key, label) => {
      if (!SORTS[key]) return `<th>${label}</th>`;
      const arrow = sort === key ? " ▲" : sort === `-${key}` ? " ▼" : "";
      return `<th class="sortable" tabindex="0" data-sort="${key}">${label}${arrow}</th>`;
    };
    const all = state.items.length > 0 && state.items.every((e) => state.selected.has(e.id));
    const head =
      `<thead><tr><th><input type="checkbox" aria-label="select all on this page"${all ? " checked" : ""}></th><th>id</th>` +
      `${th("robot_id", "robot")}${th("task", "task")}<th>outcome</th>${th("length", "length")}<th>takeovers</th>` +
      `<th>revisions</th><th>labels</th><th>flags</th>${th("created_at", "created")}</tr></thead>`;
    const rows = state.items.map((e, i) => rowHtml(e, i)).join("");
    const empty = state.items.length ? "" : '<p class="muted empty">No episode matches these filters.</p>';
    table.innerHTML = `<table class="episodes">${head}<tbody>${rows}</tbody></table>${empty}`;
  }

  function rowHtml(e, i) {
    const id = esc(e.id);
    const outcome = e.outcome || (e.success === true ? "success" : e.success === false ? "failure" : "unknown");
    const label = ([k, v]) => badgeHtml(`${k}=${typeof v === "object" && v ? v.value ?? JSON.stringify(v) : v}`, "label");
    const flag = ([k, f]) => badgeHtml(k, "flag", `${k}: ${f.detail || ""} (score ${Number(f.score).toFixed(2)})`);
    const created = esc(when(e.created_at));
    return (
      `<tr data-id="${id}" data-i="${i}"${i === state.cursor ? ' class="cursor"' : ""}>` +
      `<td><input type="checkbox" aria-label="select ${id}"${state.all || state.selected.has(e.id) ? " checked" : ""}></td>` +
      `<td class="mono"><a href="/episodes/${esc(encodeURIComponent(e.id))}" title="${id}">${id}</a></td>` +
      `<td>${esc(e.robot_id)}</td>` +
      `<td title="${esc(e.instruction)}">${esc(e.task)}</td>` +
      `<td>${badgeHtml(outcome, `oc-${e.outcome || "unknown"}`)}</td>` +
      `<td class="num">${esc(num(e.length))}</td>` +
      `<td class="num" title="${esc(e.intervention_frames || 0)} frames under human control">${e.takeovers ? esc(`${e.takeovers} (${e.intervention_frames} f)`) : "–"}</td>` +
      `<td class="mono">${(e.revisions || []).map((r) => `<span title="${esc(r)}">${esc(short(r))} </span>`).join("")}</td>` +
      `<td>${Object.entries(e.labels || {}).map(label).join("")}</td>` +
      `<td>${Object.entries(e.flags || {}).map(flag).join("")}</td>` +
      `<td title="${created}">${created}</td></tr>`
    );
  }

  /** Move the cursor's highlight to state.cursor (no redraw). */
  function markCursor() {
    table.querySelector("tr.cursor")?.classList.remove("cursor");
    table.querySelector(`tbody tr[data-i="${state.cursor}"]`)?.classList.add("cursor");
  }

  table.addEventListener("change", (ev) => {
    const box = ev.target;
    if (!(box instanceof HTMLInputElement) || box.type !== "checkbox") return;
    const row = box.closest("tbody tr");
    if (row) return toggle(row.dataset.id, box.checked);
    state.all = false; // the header box: the whole page
    for (const e of state.items) box.checked ? state.selected.add(e.id) : state.selected.delete(e.id);
    drawTable();
    drawBulk();
  });
  table.addEventListener("click", (ev) => {
    const th = ev.target.closest("th[data-sort]");
    if (th) return sortBy(th.dataset.sort);
    const row = ev.target.closest("tbody tr");
    if (row && !ev.target.closest("input,a")) {
      state.cursor = Number(row.dataset.i);
      markCursor();
    }
  });
  table.addEventListener("keydown", (ev) => {
    const th = ev.target.closest("th[data-sort]");
    if (th && ev.key === "Enter") {
      ev.stopPropagation(); // not also the page's Enter (open the episode under the cursor)
      sortBy(th.dataset.sort);
    }
  });

  function toggle(id, on) {
    if (state.all) {
      state.all = false;
      state.items.forEach((e) => state.selected.add(e.id));
    }
    on ? state.selected.add(id) : state.selected.delete(id);
    drawBulk();
    drawTable();
  }

  function drawSync(sync) {
    // the dashboard's start-up sync is still recording store episodes / computing auto-flags: the list
    // shows what the DB holds so far
    if (!sync || !sync.running) return clear(syncNote);
    const text =
      sync.phase === "flags"
        ? `computing auto-flags ${thousands(sync.flagged)}/${thousands(sync.to_flag)}`
        : sync.phase === "records" && sync.to_check > 0
          ? `syncing ${thousands(sync.checked)}/${thousands(sync.to_check)} store episodes into the DB`
          : "checking the store for episodes the DB lacks";
    clear(syncNote, h("span", { title: "the dashboard started recently; reload to see more" }, `${text}…`));
  }

  function drawPager() {
    const last = Math.max(1, Math.ceil(state.total / state.perPage));
    clear(
      pager,
      h("button", { disabled: state.page <= 1, onclick: () => goPage(state.page - 1) }, "‹ prev"),
      h("span", ` page ${state.page} of ${last} `),
      h("button", { disabled: state.page >= last, onclick: () => goPage(state.page + 1) }, "next ›"),
    );
    clear(summary, `${thousands(state.total)} episodes`);
  }

  function drawBulk() {
    const keys = normaliseSchema(ctx.schema).episode;
    const n = state.all ? state.total : state.selected.size;
    if (!keys.length) return clear(bulk);
    const keySel = h("select", { name: "bulk-key", "aria-label": "label key" }, keys.map((k) => h("option", { value: k.key }, k.key)));
    const valueSlot = h("span");
    const valueInput = () => {
      const k = keys.find((x) => x.key === keySel.value);
      const el = k.free_text || !k.values.length ? h("input", { name: "bulk-value", "aria-label": "label value", placeholder: "value" }) : h("select", { name: "bulk-value", "aria-label": "label value" }, k.values.map((v) => h("option", { value: v }, v)));
      clear(valueSlot, el);
      return el;
    };
    let valueEl = valueInput();
    keySel.addEventListener("change", () => (valueEl = valueInput()));
    const selectAll =
      state.total > state.items.length && !state.all
        ? h("button.link", { type: "button", onclick: () => ((state.all = true), drawBulk(), drawTable()) }, `select all ${thousands(state.total)} matching`)
        : null;
    const applyBtn = h("button.primary", { type: "button", disabled: n === 0 || !ctx.can("labeller"), title: ctx.can("labeller") ? "" : forbiddenText(null, ctx.session) }, `Label ${thousands(n)} selected`);
    applyBtn.addEventListener("click", async () => {
      const body = { key: keySel.value, value: valueEl.value };
      if (state.all) body.filter = Object.fromEntries([...new Set(filterOnly(query).keys())].map((k) => [k, REPEATED.has(k) ? filterOnly(query).getAll(k) : filterOnly(query).get(k)]));
      else body.episode_ids = [...state.selected];
      applyBtn.disabled = true;
      try {
        const res = await api("/labels", { method: "POST", body });
        const count = res && (res.label_ids || res.ids || res.labels || []).length;
        clear(bulkMsg, h("div.ok", `labelled ${count || n} episodes ${body.key}=${body.value}`));
        state.selected.clear();
        state.all = false;
        await load();
      } catch (e) {
        if (e.status === 403) clear(bulkMsg, h("div.error", { role: "alert" }, forbiddenText(e, ctx.session)));
        else showError(bulkMsg, e, "label");
        applyBtn.disabled = false;
      }
    });
    clear(bulk, selectAll, keySel, valueSlot, applyBtn);
  }

  const onKey = (ev) => {
    if (typing(ev) || ev.ctrlKey || ev.metaKey || ev.altKey || document.querySelector("dialog[open]")) {
      if (ev.key === "Escape" && typing(ev)) ev.target.blur();
      return;
    }
    const rows = state.items;
    const k = ev.key;
    if (k === "j" || k === "ArrowDown") state.cursor = Math.min(rows.length - 1, state.cursor + 1);
    else if (k === "k" || k === "ArrowUp") state.cursor = Math.max(0, state.cursor - 1);
    else if (k === "Enter" && rows[state.cursor]) return navigate(`/episodes/${encodeURIComponent(rows[state.cursor].id)}`);
    else if (k === "x" && rows[state.cursor]) return toggle(rows[state.cursor].id, !state.selected.has(rows[state.cursor].id));
    else if (k === "n") return goPage(state.page + 1);
    else if (k === "p") return goPage(state.page - 1);
    else if (k === "/") {
      ev.preventDefault();
      inputs.task.focus();
      return;
    } else return;
    ev.preventDefault();
    markCursor();
    table.querySelector("tr.cursor")?.scrollIntoView({ block: "nearest" });
  };
  document.addEventListener("keydown", onKey);
  await load();
  return () => {
    clearTimeout(showTimer);
    shown = true; // another page owns the root now
    document.removeEventListener("keydown", onKey);
    state.loading?.abort();
  };
}
