// One instance's page: status, controls fitted to it, input and result as JSON trees,
// what it waits on, its failures (with the traceback a record carries), the timeline
// (one line per step) and the decoded history. It reloads every second while it runs.
import { api } from "./api.js";
import { controlsSection } from "./controls.js";
import { h, when } from "./dom.js";
import { attributeItem, badge, FINISHED, headRow, instanceLink, scroll } from "./parts.js";
import { drawTimeline } from "./timeline.js";
import { repairControls } from "./repair.js";
import { jsonTree } from "./tree.js";

const POLL_MS = 1000;

// "forked from o-1 at charge#2", with a link to o-1.
function origin(text) {
  const at = text.lastIndexOf(" at ");
  const source = text.slice("forked from ".length, at);
  return h("p", { id: "origin" }, "This instance was forked from ", instanceLink(source), text.slice(at));
}

// Where a wait for a queue slot stands: ", position 2 of 5 waiting" (1 is admitted next).
function placed(w) {
  return w.position ? `, position ${w.position} of ${w.waiting} waiting` : "";
}

// The failure records of a history, newest last: each attempt that failed and the end.
function failures(history) {
  return history.filter((e) => e.type === "StepFailed" || e.type === "WorkflowFailed");
}

function failureItem(entry) {
  const a = entry.attributes;
  const where = entry.type === "WorkflowFailed" ? "the workflow" : `step ${a.key}, attempt ${a.attempt}`;
  const then = entry.type === "WorkflowFailed" ? "failed the instance"
    : a.next_attempt_at_ms != null ? `retried at ${when(new Date(a.next_attempt_at_ms).toISOString())}` : "failed for good";
  const trace = a.traceback
    ? h("pre", { class: "traceback" }, a.traceback)
    : h("p", { class: "muted" }, "No traceback: this record carries only the error type and message.");
  return h("li", { "data-type": entry.type },
    h("details", {}, h("summary", {},
      h("strong", {}, a.error_type), `: ${a.error_message}`, h("span", { class: "muted" }, ` (${where}, seq ${entry.seq}, ${then})`)),
    trace));
}

export async function instancePage(main, id) {
  const path = `/ui/api/instances/${encodeURIComponent(id)}`;
  const data = h("div", { class: "instance-data" });
  const timeline = h("section", { "aria-labelledby": "tl-h" });
  const notice = h("div", { class: "notice", role: "status", "aria-live": "polite" });
  const expanded = new Set(); // steps whose attempts are open, kept across redraws
  let latest = await api(path);
  let shown = ""; // the data last drawn, so an unchanged reload keeps trees as opened
  let timer = null;
  let stopped = false;

  const say = (text, isError = false) => {
    notice.replaceChildren(isError ? h("div", { class: "error", role: "alert" }, text) : h("p", { class: "ok" }, text));
  };
  const refresh = async () => {
    clearTimeout(timer);
    try {
      latest = await api(path);
      draw();
    } catch (err) {
      say(`${err.type}: ${err.message}`, true);
    }
    schedule();
  };
  const schedule = () => {
    if (!stopped && !FINISHED.has(latest.status.status)) timer = setTimeout(refresh, POLL_MS);
  };
  const send = async (control, body, done) => {
    try {
      await api(`${path}/${control}`, { method: "POST", body });
      say(done);
      await refresh();
    } catch (err) {
      say(`${err.type}: ${err.message}`, true);
    }
  };
  const controls = controlsSection({
    send, say, notice, awaited: (name) => latest.status.waits.some((w) => w.event === name),
  });

  const repair = repairControls(path, say, refresh);

  function drawData() {
    const s = latest.status;
    const live = !FINISHED.has(s.status);
    const waits = s.waits.length
      ? scroll(h("table", { class: "data", id: "waits" }, headRow("Key", "Kind", "State", "Attempt", "Until", "Event"),
        h("tbody", {}, ...s.waits.map((w) => h("tr", {}, h("td", {}, w.key), h("td", {}, w.kind), h("td", {}, w.state),
          h("td", {}, w.attempt || ""), h("td", {}, when(w.until)),
          h("td", {}, w.queue ? `a slot of queue ${w.queue}${placed(w)}` : w.event || ""))))))
      : h("p", {}, live ? "Nothing: it is between steps." : "Nothing: it has finished.");
    const children = latest.timeline.filter((r) => r.kind === "child");
    const failed = failures(latest.history);
    const end = failed.find((e) => e.type === "WorkflowFailed");
    const result = s.status === "completed" ? jsonTree(latest.result, { id: "result" })
      : h("pre", { id: "result" }, s.status === "failed" || s.status === "cancelled" ? `(${s.status})` : "(not finished)");
    data.replaceChildren(
      h("p", { class: "meta" }, badge(s.status), ` ${s.workflow} v${s.version} · created `,
        h("time", { datetime: s.created_at }, when(s.created_at)), " · updated ",
        h("time", { datetime: s.updated_at }, when(s.updated_at)),
        live ? h("span", { class: "live" }, " · updating live") : ""),
      s.error ? h("div", { class: "error", id: "instance-error" }, h("strong", {}, "Error: "), s.error,
        end?.attributes.traceback ? h("details", {}, h("summary", {}, "Traceback"), h("pre", { class: "traceback" }, end.attributes.traceback)) : "") : "",
      s.origin ? origin(s.origin) : "",
      Object.keys(s.attributes || {}).length ? h("section", { "aria-labelledby": "attrs-h" },
        h("h2", { id: "attrs-h" }, "Search attributes"),
        h("table", { class: "data", id: "attributes" }, h("tbody", {}, ...Object.entries(s.attributes).map(([k, v]) =>
          h("tr", {}, h("th", { scope: "row" }, h("a", { href: `#/?attrs=${encodeURIComponent(attributeItem(k, v))}` }, k)),
            h("td", {}, typeof v === "string" ? v : JSON.stringify(v))))))) : "",
      h("div", { class: "io" },
        h("section", { "aria-labelledby": "in-h" }, h("h2", { id: "in-h" }, "Input"), jsonTree(latest.input, { id: "input" })),
        h("section", { "aria-labelledby": "out-h" }, h("h2", { id: "out-h" }, "Result"), result)),
      h("section", { "aria-labelledby": "waits-h" }, h("h2", { id: "waits-h" }, "Waiting on"), waits),
      children.length ? h("section", { "aria-labelledby": "children-h" }, h("h2", { id: "children-h" }, "Children"),
        h("ul", {}, ...children.map((c) => h("li", {}, instanceLink(c.name), ` ${c.outcome}`)))) : "",
      failed.length ? h("section", { "aria-labelledby": "fail-h" }, h("h2", { id: "fail-h" }, `Failures (${failed.length})`),
        h("ul", { class: "failures", id: "failures" }, ...failed.map(failureItem))) : "",
      timeline,
      h("section", { "aria-labelledby": "hist-h" }, h("h2", { id: "hist-h" }, `History (${latest.history.length} records)`),
        scroll(h("table", { class: "data history", id: "history" }, headRow("Seq", "Time", "Type", "Attributes"),
          h("tbody", {}, ...latest.history.map((e) => h("tr", { class: e.set_aside ? "set-aside" : false }, h("td", {}, e.seq),
            h("td", {}, h("time", { datetime: e.time }, e.time.slice(11, 23))),
            h("td", {}, e.type, e.set_aside ? " (set aside by a reset)" : ""),
            h("td", {}, jsonTree(e.attributes, { open: 1 })))))))));
  }

  function draw() {
    const s = latest.status;
    controls.update(s);
    repair.update(latest);
    const now = JSON.stringify(latest);
    if (now !== shown) {
      shown = now;
      drawData();
    }
    const start = latest.history.length ? Date.parse(latest.history[0].time) : Date.now();
    timeline.replaceChildren(h("h2", { id: "tl-h" }, "Timeline"),
      drawTimeline(latest.timeline, Date.now() - start, !FINISHED.has(s.status), expanded));
  }

  main.replaceChildren(h("p", {}, h("a", { href: "#/" }, "← Instances")),
    h("h1", { tabindex: "-1", class: "instance-id" }, id), controls.section, repair, data);
  draw();
  schedule();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
