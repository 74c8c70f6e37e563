// The step timeline drawn to time scale (CSS bars over a shared axis), from the rows
// of ops/tools/timeline.py: one line per step with its attempts on it (and the backoff
// before each retry; a click shows them as a table), sleeps, waits, children,
// compensations (steps named ".../undo") and points in time.
import { h } from "./dom.js";

export function duration(ms) {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(2)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(Math.round(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m`;
}

// One line per step (all its attempts on it, in order) and one per anything else.
function lines(rows) {
  const out = [];
  const steps = new Map();
  for (const row of rows) {
    const kind = kindOf(row);
    if (row.kind !== "step") {
      out.push({ kind, name: row.name, attempts: [row] });
      continue;
    }
    let line = steps.get(row.name);
    if (!line) {
      line = { kind, name: row.name, attempts: [] };
      steps.set(row.name, line);
      out.push(line);
    }
    line.attempts.push(row);
  }
  return out;
}

function kindOf(row) {
  return row.kind === "step" && /\/undo(#\d+)?$/.test(row.name) ? "compensation" : row.kind;
}

// rows: the model; sinceStartMs: the time now, in ms since the first record (open
// spans run up to it while the instance runs); expanded: the names of the steps whose
// attempts are shown (kept across redraws).
export function drawTimeline(rows, sinceStartMs, running, expanded = new Set()) {
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
  const describe = (row, kind) => [`${kind} ${row.name}`.trim(), row.outcome, `at +${duration(row.at_ms)}`,
    row.took_ms != null ? `took ${duration(row.took_ms)}` : row.is_span && row.took_ms == null ? "still open" : "", row.detail]
    .filter(Boolean).join(" · ");
  const items = [];
  for (const line of lines(rows)) {
    const { kind, attempts } = line;
    const last = attempts.at(-1);
    const track = h("span", { class: "tl-track" });
    for (const [n, row] of attempts.entries()) {
      const open = row.is_span && row.took_ms == null;
      const took = row.took_ms ?? (open && running ? Math.max(0, sinceStartMs - row.at_ms) : 0);
      const text = (attempts.length > 1 ? `attempt ${n + 1}: ` : "") + describe(row, kind);
      if (row.is_span) {
        track.append(place(h("span", { class: `tl-bar${open ? " tl-open" : ""}${kind === "step" || kind === "compensation" ? " tl-attempt" : ""}`,
          "data-outcome": row.outcome, title: text }), row.at_ms, row.at_ms + took));
      } else {
        const dot = h("span", { class: "tl-point", "data-outcome": row.outcome, title: text });
        dot.style.left = pct(row.at_ms);
        track.append(dot);
      }
      if (row.retry_at_ms != null) {
        const from = row.at_ms + (row.took_ms ?? 0);
        track.append(place(h("span", { class: "tl-backoff", title: `backoff until +${duration(row.retry_at_ms)}` }), from, row.retry_at_ms));
      }
    }
    const many = attempts.length > 1 ? ` · ${attempts.length} attempts` : "";
    const outcome = h("span", { class: "tl-outcome" }, last.outcome, last.took_ms != null ? ` ${duration(last.took_ms)}` : "", many);
    const li = h("li", { class: "tl-row", "data-kind": kind, "data-outcome": last.outcome, "data-attempts": attempts.length });
    if (kind === "step" || kind === "compensation") {
      // Its attempts in detail, under the row, on a click of its name or of a bar.
      const details = h("li", { class: "tl-details", hidden: !expanded.has(line.name) },
        h("table", { class: "data attempts" },
          h("caption", {}, `Attempts of ${line.name}`),
          h("thead", {}, h("tr", {}, ...["attempt", "at", "took", "outcome", "detail"].map((c) => h("th", { scope: "col" }, c)))),
          h("tbody", {}, ...attempts.map((row, n) => h("tr", {}, h("td", {}, n + 1), h("td", {}, `+${duration(row.at_ms)}`),
            h("td", {}, row.took_ms != null ? duration(row.took_ms) : "…"), h("td", {}, row.outcome), h("td", {}, row.detail))))));
      const toggle = h("button", { type: "button", class: "tl-toggle", "aria-expanded": String(!details.hidden), onclick: () => {
        details.hidden = !details.hidden;
        if (details.hidden) expanded.delete(line.name);
        else expanded.add(line.name);
        toggle.setAttribute("aria-expanded", String(!details.hidden));
      } }, h("span", { class: "tl-kind" }, kind), " ", line.name);
      track.addEventListener("click", () => toggle.click());
      li.append(h("span", { class: "tl-label" }, toggle), track, outcome);
      items.push(li, details);
    } else {
      li.append(h("span", { class: "tl-label" }, h("span", { class: "tl-kind" }, kind), " ", line.name), track, outcome);
      items.push(li);
    }
  }
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
