// Small pieces the pages share: status badges, links to instances, table heads.
import { h } from "./dom.js";

export const STATUSES = ["pending", "running", "paused", "completed", "failed", "cancelled", "terminated"];
export const FINISHED = new Set(["completed", "failed", "cancelled", "terminated"]);

export const badge = (status) => h("span", { class: `badge badge-${status}` }, status);
export const instanceLink = (id) => h("a", { href: `#/i/${encodeURIComponent(id)}` }, id);
export const scroll = (table) => h("div", { class: "scroll" }, table);
export const headRow = (...names) => h("thead", {}, h("tr", {}, ...names.map((n) => h("th", { scope: "col" }, n))));

// An attribute as the filter takes it: text quoted when it would read as a number or a
// bool, or holds a comma or a quote (the filter's separators).
export function attributeItem(key, value) {
  let plain = typeof value === "string" && !/[",]/.test(value);
  if (plain) { try { plain = typeof JSON.parse(value) === "string"; } catch { plain = true; } }
  return `${key}=${plain ? value : JSON.stringify(value)}`;
}
