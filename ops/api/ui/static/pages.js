// The three pages: the instance list, one instance (with its controls), definitions.
import { api } from "./api.js";
import { h, json, when } from "./dom.js";
import { drawTimeline } from "./timeline.js";

const STATUSES = ["pending", "running", "paused", "completed", "failed", "cancelled", "terminated"];
const FINISHED = new Set(["completed", "failed", "cancelled", "terminated"]);
const POLL_MS = 1000;
const PAGE_SIZE = 50;

const badge = (status) => h("span", { class: `badge badge-${status}` }, status);
const instanceLink = (id) => h("a", { href: `#/i/${encodeURIComponent(id)}` }, id);
const scroll = (table) => h("div", { class: "scroll" }, table);
const headRow = (...names) => h("thead", {}, h("tr", {}, ...names.map((n) => h("th", { scope: "col" }, n))));

function listHash(params) {
  const query = new URLSearchParams([...params].filter(([, v]) => v)).toString();
  return `#/${query ? `?${query}` : ""}`;
}

export async function listPage(main, params) {
  const query = new URLSearchParams({ limit: params.get("limit") || String(PAGE_SIZE) });
  for (const name of ["status", "workflow", "prefix", "after"]) {
    if (params.get(name)) query.set(name, params.get(name));
  }
  const [page, workflows] = await Promise.all([
    api(`/ui/api/instances?${query}`),
    api("/v1/workflows").catch(() => ({ workflows: {} })),
  ]);
  const field = (id, label, control) => h("div", { class: "field" }, h("label", { for: id }, label), control);
  const status = h("select", { id: "f-status", name: "status" },
    h("option", { value: "" }, "any"),
    ...STATUSES.map((s) => h("option", { value: s, selected: params.get("status") === s }, s)));
  const workflow = h("input", { id: "f-workflow", name: "workflow", list: "f-workflows", value: params.get("workflow") || "", autocomplete: "off" });
  const prefix = h("input", { id: "f-prefix", name: "prefix", value: params.get("prefix") || "", autocomplete: "off", spellcheck: "false" });
  const form = h("form", { class: "filters", role: "search", "aria-label": "Filter instances", onsubmit: (e) => {
    e.preventDefault();
    performance.mark("stepstream:filter-sent");
    location.hash = listHash(new URLSearchParams({ status: status.value, workflow: workflow.value.trim(), prefix: prefix.value }));
  } },
  field("f-status", "Status", status),
  field("f-workflow", "Workflow", workflow),
  h("datalist", { id: "f-workflows" }, ...Object.keys(workflows.workflows).map((w) => h("option", { value: w }))),
  field("f-prefix", "Id starts with", prefix),
  h("div", { class: "field actions" }, h("button", { type: "submit" }, "Filter"),
    h("a", { class: "button secondary", href: "#/" }, "Clear")));

  const rows = page.instances.map((i) => h("tr", {},
    h("td", {}, instanceLink(i.instance_id)),
    h("td", {}, badge(i.status)),
    h("td", {}, i.workflow), h("td", {}, i.version),
    h("td", {}, h("time", { datetime: i.created_at }, when(i.created_at))),
    h("td", {}, h("time", { datetime: i.updated_at }, when(i.updated_at))),
    h("td", { class: "err", title: i.error || "" }, i.error || "")));
  const table = h("table", { class: "data", id: "instances" },
    h("caption", {}, page.instances.length ? `${page.instances.length} instances${params.get("after") ? ` after ${params.get("after")}` : ""}` : "No instances match"),
    headRow("Instance", "Status", "Workflow", "Version", "Created", "Updated", "Error"),
    h("tbody", {}, ...rows));
  const pager = h("nav", { class: "pager", "aria-label": "Pages" });
  if (params.get("after")) {
    const first = new URLSearchParams(params);
    first.delete("after");
    pager.append(h("a", { href: listHash(first) }, "First page"));
  }
  if (page.next) {
    const next = new URLSearchParams(params);
    next.set("after", page.next);
    pager.append(h("a", { href: listHash(next), rel: "next" }, "Next page"));
  }
  main.replaceChildren(h("h1", { tabindex: "-1" }, "Instances"), form, scroll(table), pager);
  performance.mark("stepstream:list-shown"); // read by tests/ui_scale.py
}

export async function instancePage(main, id) {
  const path = `/ui/api/instances/${encodeURIComponent(id)}`;
  const data = h("div", { class: "instance-data" });
  const notice = h("div", { class: "notice", role: "status", "aria-live": "polite" });
  let latest = await api(path);
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

  // Controls stay enabled whatever the status: the server decides, and says why not.
  const reason = h("input", { id: "c-reason", autocomplete: "off" });
  const eventName = h("input", { id: "c-event", list: "c-events", required: true, autocomplete: "off" });
  const events = h("datalist", { id: "c-events" });
  const payload = h("textarea", { id: "c-payload", rows: 3, spellcheck: "false", placeholder: '{"approved": true}' });
  const controls = h("section", { class: "controls", "aria-labelledby": "controls-h" },
    h("h2", { id: "controls-h" }, "Controls"),
    h("div", { class: "row" },
      h("button", { type: "button", id: "c-pause", onclick: () => send("pause", {}, "Pause sent.") }, "Pause"),
      h("button", { type: "button", id: "c-resume", onclick: () => send("resume", {}, "Resume sent.") }, "Resume")),
    h("form", { class: "row", onsubmit: (e) => {
      e.preventDefault();
      send("cancel", { reason: reason.value }, "Cancel sent.");
    } }, h("div", { class: "field" }, h("label", { for: "c-reason" }, "Reason"), reason),
    h("button", { type: "submit", class: "danger" }, "Cancel instance"),
    h("button", { type: "button", id: "c-terminate", class: "danger",
      onclick: () => send("terminate", { reason: reason.value }, "Terminate sent.") }, "Terminate")),
    h("form", { class: "row", novalidate: true, onsubmit: (e) => {
      e.preventDefault();
      const name = eventName.value.trim();
      if (!name) {
        eventName.setAttribute("aria-invalid", "true");
        eventName.focus();
        return say("Give the event a name: the one the workflow waits for.", true);
      }
      eventName.removeAttribute("aria-invalid");
      let value;
      if (payload.value.trim()) {
        try {
          value = JSON.parse(payload.value);
        } catch (err) {
          payload.setAttribute("aria-invalid", "true");
          payload.focus();
          return say(`The payload is not valid JSON (${err.message}). Write JSON, for example {"approved": true} or "text" in quotes, or leave it empty.`, true);
        }
      }
      payload.removeAttribute("aria-invalid");
      const awaited = latest.status.waits.some((w) => w.event === name);
      send("events", value === undefined ? { name } : { name, payload: value },
        awaited ? `Event "${name}" sent.` : `Event "${name}" sent; nothing waits for it now, so the instance keeps it until it does.`);
    } },
    h("div", { class: "field" }, h("label", { for: "c-event" }, "Event name"), eventName, events),
    h("div", { class: "field grow" }, h("label", { for: "c-payload" }, "Payload (JSON)"), payload),
    h("button", { type: "submit" }, "Send event")),
    notice);

  function draw() {
    const s = latest.status;
    const live = !FINISHED.has(s.status);
    events.replaceChildren(...s.waits.filter((w) => w.event).map((w) => h("option", { value: w.event })));
    const start = latest.history.length ? Date.parse(latest.history[0].time) : Date.now();
    const waits = s.waits.length
      ? scroll(h("table", { class: "data", id: "waits" }, headRow("Key", "Kind", "State", "Attempt", "Until", "Event"),
        h("tbody", {}, ...s.waits.map((w) => h("tr", {}, h("td", {}, w.key), h("td", {}, w.kind), h("td", {}, w.state),
          h("td", {}, w.attempt || ""), h("td", {}, when(w.until)), h("td", {}, w.event || ""))))))
      : h("p", {}, live ? "Nothing: it is between steps." : "Nothing: it has finished.");
    const children = latest.timeline.filter((r) => r.kind === "child");
    data.replaceChildren(
      h("p", { class: "meta" }, badge(s.status), ` ${s.workflow} v${s.version} · created `,
        h("time", { datetime: s.created_at }, when(s.created_at)), " · updated ",
        h("time", { datetime: s.updated_at }, when(s.updated_at)),
        live ? h("span", { class: "live" }, " · updating live") : ""),
      s.error ? h("div", { class: "error", id: "instance-error" }, h("strong", {}, "Error: "), s.error) : "",
      h("div", { class: "io" },
        h("section", { "aria-labelledby": "in-h" }, h("h2", { id: "in-h" }, "Input"), h("pre", { id: "input" }, json(latest.input))),
        h("section", { "aria-labelledby": "out-h" }, h("h2", { id: "out-h" }, "Result"),
          h("pre", { id: "result" }, s.status === "completed" ? json(latest.result) : s.status === "failed" || s.status === "cancelled" || s.status === "terminated" ? `(${s.status})` : "(not finished)"))),
      h("section", { "aria-labelledby": "waits-h" }, h("h2", { id: "waits-h" }, "Waiting on"), waits),
      children.length ? h("section", { "aria-labelledby": "children-h" }, h("h2", { id: "children-h" }, "Children"),
        h("ul", {}, ...children.map((c) => h("li", {}, instanceLink(c.name), ` ${c.outcome}`)))) : "",
      h("section", { "aria-labelledby": "tl-h" }, h("h2", { id: "tl-h" }, "Timeline"),
        drawTimeline(latest.timeline, Date.now() - start, live)),
      h("section", { "aria-labelledby": "hist-h" }, h("h2", { id: "hist-h" }, `History (${latest.history.length} records)`),
        scroll(h("table", { class: "data history", id: "history" }, headRow("Seq", "Time", "Type", "Attributes"),
          h("tbody", {}, ...latest.history.map((e) => h("tr", {}, h("td", {}, e.seq),
            h("td", {}, h("time", { datetime: e.time }, e.time.slice(11, 23))), h("td", {}, e.type),
            h("td", {}, h("code", {}, JSON.stringify(e.attributes))))))))));
  }

  main.replaceChildren(h("p", {}, h("a", { href: "#/" }, "← Instances")),
    h("h1", { tabindex: "-1", class: "instance-id" }, id), controls, data);
  draw();
  schedule();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

export async function definitionsPage(main) {
  const { workflows, overview } = await api("/ui/api/definitions");
  const counts = overview.counts;
  const total = Object.values(counts).reduce((a, b) => a + b, 0);
  const hour = overview.finished_last_hour;
  main.replaceChildren(
    h("h1", { tabindex: "-1" }, "Definitions"),
    h("section", { "aria-labelledby": "wf-h" }, h("h2", { id: "wf-h" }, "Deployed workflows"),
      scroll(h("table", { class: "data", id: "workflows" }, headRow("Workflow", "Versions", ""),
        h("tbody", {}, ...Object.entries(workflows).map(([name, versions]) => h("tr", {},
          h("td", {}, name), h("td", {}, versions.join(", ")),
          h("td", {}, h("a", { href: `#/?workflow=${encodeURIComponent(name)}` }, `instances of ${name}`)))))))),
    h("section", { "aria-labelledby": "ov-h" }, h("h2", { id: "ov-h" }, "Overview"),
      h("dl", { class: "counts", id: "counts" },
        h("div", {}, h("dt", {}, "all"), h("dd", {}, total)),
        ...STATUSES.map((s) => h("div", {}, h("dt", {}, h("a", { href: `#/?status=${s}` }, s)), h("dd", {}, counts[s] || 0)))),
      h("p", { id: "throughput" }, `Last hour: ${hour.completed || 0} completed, ${hour.failed || 0} failed, ${hour.cancelled || 0} cancelled.`)),
    h("section", { "aria-labelledby": "fail-h" }, h("h2", { id: "fail-h" }, "Recent failures (last hour)"),
      overview.recent_failures.length
        ? scroll(h("table", { class: "data", id: "failures" }, headRow("Instance", "Workflow", "Failed at", "Error"),
          h("tbody", {}, ...overview.recent_failures.map((f) => h("tr", {}, h("td", {}, instanceLink(f.instance_id)),
            h("td", {}, `${f.workflow} v${f.version}`), h("td", {}, when(f.updated_at)), h("td", { class: "err" }, f.error || ""))))))
        : h("p", {}, "None.")));
}
