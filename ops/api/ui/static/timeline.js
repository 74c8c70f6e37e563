// The step timeline drawn to time scale (CSS bars over a shared axis), from the rows
// of ops/tools/timeline.py: attempts, their backoff until the next attempt, sleeps, waits,
// children, compensations (steps named ".../undo") and points in time.
import { h } from "./dom.js";

export function duration(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(2)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(Math.round(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m`;
}

function kindOf(row) {
  return row.kind === "step" && /\/undo(#\d+)?$/.test(row.name) ? "compensation" : row.kind;
}

// rows: the model; sinceStartMs: the time now, in ms since the first record (open
// spans run up to it while the instance runs).
export function drawTimeline(rows, sinceStartMs, running) {
  let end = 1;
  for (const row of rows) {
    end = Math.max(end, row.at_ms + (row.took_ms ?? 0));
    if (row.retry_at_ms != null) end = Math.max(end, row.retry_at_ms);
  }
  if (running) end = Math.max(end, sinceStartMs);
  const pct = (ms) => `${Math.min(100, Math.max(0, (ms / end) * 100))}%`;
  const place = (el, from, to) => {
    el.style.left = pct(from);
    el.style.width = `max(3px, ${pct(Math.max(0, to - from))})`;
    return el;
  };
  const axis = h("li", { class: "tl-row tl-axis", "aria-hidden": "true" },
    h("span", { class: "tl-label" }, "time"),
    h("span", { class: "tl-track" },
      ...[0, 0.25, 0.5, 0.75, 1].map((f) => {
        const tick = h("span", { class: "tl-tick" }, `+${duration(end * f)}`);
        tick.style.left = pct(end * f);
        return tick;
      })));
  const items = rows.map((row) => {
    const kind = kindOf(row);
    const open = row.is_span && row.took_ms == null;
    const took = row.took_ms ?? (open && running ? Math.max(0, sinceStartMs - row.at_ms) : 0);
    const text = [`${kind} ${row.name}`.trim(), row.outcome, `at +${duration(row.at_ms)}`,
      row.took_ms != null ? `took ${duration(row.took_ms)}` : open ? "still open" : "", row.detail]
      .filter(Boolean).join(" · ");
    const track = h("span", { class: "tl-track" });
    if (row.is_span) {
      track.append(place(h("span", { class: `tl-bar${open ? " tl-open" : ""}`, title: text }), row.at_ms, row.at_ms + took));
    } else {
      const dot = h("span", { class: "tl-point", title: text });
      dot.style.left = pct(row.at_ms);
      track.append(dot);
    }
    if (row.retry_at_ms != null) {
      const from = row.at_ms + (row.took_ms ?? 0);
      track.append(place(h("span", { class: "tl-backoff", title: `backoff until +${duration(row.retry_at_ms)}` }), from, row.retry_at_ms));
    }
    return h("li", { class: "tl-row", "data-kind": kind, "data-outcome": row.outcome },
      h("span", { class: "tl-label" }, h("span", { class: "tl-kind" }, kind), " ", row.name),
      track,
      h("span", { class: "tl-outcome" }, row.outcome, row.took_ms != null ? ` ${duration(row.took_ms)}` : ""));
  });
  const chart = h("ol", { class: "tl", "aria-label": `Timeline over ${duration(end)}` }, axis, ...items);
  const table = h("table", { class: "data" },
    h("caption", {}, "Timeline rows"),
    h("thead", {}, h("tr", {}, ...["at", "kind", "name", "outcome", "took", "detail"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, ...rows.map((row) => h("tr", {},
      h("td", {}, `+${duration(row.at_ms)}`), h("td", {}, kindOf(row)), h("td", {}, row.name),
      h("td", {}, row.outcome), h("td", {}, row.took_ms != null ? duration(row.took_ms) : row.is_span ? "…" : ""),
      h("td", {}, row.detail)))));
  return h("div", { class: "timeline" }, h("div", { class: "scroll" }, chart),
    h("details", {}, h("summary", {}, "Timeline as a table"), h("div", { class: "scroll" }, table)));
}
