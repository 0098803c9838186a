// The label schema (a project file served at /label-schema) and label history helpers.

/** {episode: [{key, values?, shortcut?, free_text?}], span: [...]} whatever shape the server sent. */
export function normaliseSchema(schema) {
  const s = schema || {};
  const norm = (list) =>
    (Array.isArray(list) ? list : Object.entries(list || {}).map(([key, v]) => ({ key, ...(Array.isArray(v) ? { values: v } : v) }))).map((e) => ({
      key: e.key,
      values: e.values || [],
      shortcut: e.shortcut || "",
      free_text: Boolean(e.free_text),
      description: e.description || e.help || "",
    }));
  return { episode: norm(s.episode || s.episodes), span: norm(s.span || s.spans) };
}

/** Flatten the span values so digits 1..9 map to [{key, value}]. */
export function spanShortcuts(schema) {
  const out = [];
  for (const e of schema.span) for (const v of e.values) out.push({ key: e.key, value: v });
  return out.slice(0, 9);
}

/** Label events that are in force: not undo events, not undone. */
export function activeEvents(history) {
  const undone = new Set((history || []).filter((e) => e.undoes !== null && e.undoes !== undefined).map((e) => e.undoes));
  return (history || []).filter((e) => (e.undoes === null || e.undoes === undefined) && !undone.has(e.id));
}

/** Current span labels (events with start/end in force). */
export function currentSpans(history) {
  return activeEvents(history).filter((e) => e.start !== null && e.start !== undefined);
}

/** Current episode-level value per key (latest event in force). */
export function currentValues(history) {
  const out = {};
  const evs = activeEvents(history).filter((e) => e.start === null || e.start === undefined);
  evs.sort((a, b) => cmpTime(a, b));
  for (const e of evs) out[e.key] = e;
  return out;
}

function cmpTime(a, b) {
  const ta = typeof a.created_at === "number" ? a.created_at : Date.parse(a.created_at) / 1000;
  const tb = typeof b.created_at === "number" ? b.created_at : Date.parse(b.created_at) / 1000;
  return ta - tb || (a.id > b.id ? 1 : -1);
}

/** The message a 403 shows: "your role (viewer) cannot label: ..." */
export function forbiddenText(err, session, action = "label") {
  return `your role (${session ? session.role : "unknown"}) cannot ${action}${err && err.message ? ` — ${err.message}` : ""}`;
}
