// The instance list (newest first, filtered, within a time range) and the definitions
// page; one instance's page is instance.js.
import { api } from "./api.js";
import { h, when } from "./dom.js";
import { attributeItem, badge, headRow, instanceLink, scroll, STATUSES } from "./parts.js";

const PAGE_SIZE = 50;
const ORDERS = [["newest", "Newest first"], ["oldest", "Oldest first"], ["id", "By id"]];
const RECENT = [["1h", "last hour"], ["24h", "last 24 h"], ["7d", "last 7 days"]];

// A datetime-local field's value as an ISO time (UTC), and back.
const toIso = (local) => (local ? new Date(local).toISOString() : "");
function toLocal(iso) {
  const d = new Date(iso);
  if (!iso || Number.isNaN(d.getTime()) || !/^\d{4}-/.test(iso)) return "";
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

// The filter's items: split at the commas outside double quotes ("Smith, John" is one).
function items(text) {
  const found = [];
  let item = "";
  let quoted = false;
  for (let i = 0; i < text.length; i += 1) {
    const c = text[i];
    if (c === "\\" && quoted) { item += c + (text[i + 1] ?? ""); i += 1; continue; }
    if (c === '"') quoted = !quoted;
    if (c === "," && !quoted) { found.push(item); item = ""; } else item += c;
  }
  found.push(item);
  return found.map((t) => t.trim()).filter(Boolean);
}

// The attribute filter as typed ("customer=42, vip=true") as the where of the API: a
// number, true or false matches that value or the same text (as `stepstream list
// --where` does), a quoted string only that text. Null with the item it cannot read, or
// the key it gives twice (every key must match, and an attribute has one value).
export function whereOf(text) {
  const where = {};
  for (const item of items(text)) {
    const at = item.indexOf("=");
    if (at < 1) return { where: null, bad: item };
    const key = item.slice(0, at).trim();
    if (Object.hasOwn(where, key)) return { where: null, bad: item, twice: key };
    const raw = item.slice(at + 1).trim();
    let value = raw;
    try { value = JSON.parse(raw); } catch { value = raw; }
    where[key] = typeof value === "string" ? value
      : typeof value === "number" || typeof value === "boolean" ? [value, raw] : raw;
  }
  return { where, bad: null };
}

const attributeText = (attrs) => Object.entries(attrs || {}).map(([k, v]) => attributeItem(k, v)).join(", ");

function listHash(params) {
  const query = new URLSearchParams([...params].filter(([, v]) => v)).toString();
  return `#/${query ? `?${query}` : ""}`;
}

export async function listPage(main, params) {
  const asked = location.hash;
  const order = params.get("order") || "newest";
  const query = new URLSearchParams({ limit: params.get("limit") || String(PAGE_SIZE), order });
  for (const name of ["status", "workflow", "prefix", "after", "since", "until"]) {
    if (params.get(name)) query.set(name, params.get(name));
  }
  const { where, bad, twice } = whereOf(params.get("attrs") || "");
  if (where && Object.keys(where).length) query.set("where", JSON.stringify(where));
  const [page, workflows] = await Promise.all([
    bad ? { instances: [], next: null } : api(`/ui/api/instances?${query}`),
    api("/v1/workflows").catch(() => ({ workflows: {} })),
  ]);
  const field = (id, label, control) => h("div", { class: "field" }, h("label", { for: id }, label), control);
  const status = h("select", { id: "f-status", name: "status" },
    h("option", { value: "" }, "any"),
    ...STATUSES.map((s) => h("option", { value: s, selected: params.get("status") === s }, s)));
  const workflow = h("input", { id: "f-workflow", name: "workflow", list: "f-workflows", value: params.get("workflow") || "", autocomplete: "off" });
  const prefix = h("input", { id: "f-prefix", name: "prefix", value: params.get("prefix") || "", autocomplete: "off", spellcheck: "false" });
  const attrs = h("input", { id: "f-attrs", name: "attrs", value: params.get("attrs") || "", placeholder: "customer=42, vip=true", autocomplete: "off", spellcheck: "false" });
  const sort = h("select", { id: "f-order", name: "order" },
    ...ORDERS.map(([value, label]) => h("option", { value, selected: order === value }, label)));
  // A relative since (the "last hour" links) shows as empty here and as the current link.
  const since = h("input", { id: "f-since", type: "datetime-local", step: 1, value: toLocal(params.get("since")) });
  const until = h("input", { id: "f-until", type: "datetime-local", step: 1, value: toLocal(params.get("until")) });
  const filters = (more = {}) => new URLSearchParams({
    status: status.value, workflow: workflow.value.trim(), prefix: prefix.value, attrs: attrs.value.trim(),
    order: sort.value === "newest" ? "" : sort.value, until: toIso(until.value),
    since: toIso(since.value) || (RECENT.some(([v]) => v === params.get("since")) ? params.get("since") : ""), ...more,
  });
  const form = h("form", { class: "filters", role: "search", "aria-label": "Filter instances", onsubmit: (e) => {
    e.preventDefault();
    performance.mark("stepstream:filter-sent");
    location.hash = listHash(filters());
  } },
  field("f-status", "Status", status),
  field("f-workflow", "Workflow", workflow),
  h("datalist", { id: "f-workflows" }, ...Object.keys(workflows.workflows).map((w) => h("option", { value: w }))),
  field("f-prefix", "Id starts with", prefix),
  field("f-attrs", "Attributes", attrs),
  field("f-since", "Started since", since),
  field("f-until", "Started before", until),
  field("f-order", "Sort", sort),
  h("div", { class: "field actions" }, h("button", { type: "submit" }, "Filter"),
    h("a", { class: "button secondary", href: "#/" }, "Clear")));
  const recent = h("p", { class: "recent" }, "Started in the ",
    ...RECENT.flatMap(([value, label], n) => [n ? " · " : "",
      h("a", { href: listHash(filters({ since: value, until: "" })), "aria-current": params.get("since") === value ? "true" : false }, label)]));

  const rows = page.instances.map((i) => h("tr", {},
    h("td", {}, instanceLink(i.instance_id)),
    h("td", {}, badge(i.status)),
    h("td", {}, i.workflow), h("td", {}, i.version),
    h("td", {}, h("time", { datetime: i.created_at }, when(i.created_at))),
    h("td", {}, h("time", { datetime: i.updated_at }, when(i.updated_at))),
    h("td", { class: "attrs" }, attributeText(i.attributes)),
    h("td", { class: "err", title: i.error || "" }, i.error || "")));
  const table = h("table", { class: "data", id: "instances" },
    h("caption", {}, page.instances.length ? `${page.instances.length} instances${params.get("after") ? ` after ${params.get("after")}` : ""}` : "No instances match"),
    headRow("Instance", "Status", "Workflow", "Version", "Started", "Updated", "Attributes", "Error"),
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
  const refused = bad ? h("p", { class: "error", id: "attrs-error", role: "alert" },
    twice ? `Attributes: ${twice} is given twice; every key must match and an attribute has one value, so give each key once`
      : `Attributes: "${bad}" is not KEY=VALUE; separate several with commas, as in customer=42, vip=true`) : "";
  // A newer filter was asked for while this page loaded: its render wins, not this one.
  if (location.hash !== asked) return;
  main.replaceChildren(h("h1", { tabindex: "-1" }, "Instances"), form, refused, recent, scroll(table), pager);
  performance.mark("stepstream:list-shown"); // read by tests/ui_scale.py
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
