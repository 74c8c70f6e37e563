// A JSON value as a small collapsible tree: objects and arrays are <details> (open to
// `open` levels deep), everything else a typed leaf. Keys and values are text nodes.
import { h } from "./dom.js";

const LEAF_CLASS = { string: "j-str", number: "j-num", boolean: "j-bool" };

function leaf(value) {
  if (value === null) return h("span", { class: "j-null" }, "null");
  const type = typeof value;
  // Text of several lines (a traceback) reads as lines, not as one escaped string.
  if (type === "string" && value.includes("\n")) return h("span", { class: "j-str j-lines" }, value);
  return h("span", { class: LEAF_CLASS[type] || "j-str" }, type === "string" ? JSON.stringify(value) : String(value));
}

function node(value, depth, open) {
  if (value === null || typeof value !== "object") return leaf(value);
  const isArray = Array.isArray(value);
  const entries = isArray ? value.map((v, i) => [i, v]) : Object.entries(value);
  if (!entries.length) return h("span", { class: "j-empty" }, isArray ? "[]" : "{}");
  const size = isArray ? `[${entries.length} item${entries.length === 1 ? "" : "s"}]` : `{${entries.length} key${entries.length === 1 ? "" : "s"}}`;
  return h("details", { class: "j-node", open: depth < open },
    h("summary", {}, h("span", { class: "j-size" }, size)),
    h("ul", {}, ...entries.map(([k, v]) => h("li", {},
      h("span", { class: isArray ? "j-index" : "j-key" }, String(k)), ": ", node(v, depth + 1, open)))));
}

// value undefined: nothing recorded.
export function jsonTree(value, { open = 2, id } = {}) {
  const root = h("div", { class: "json-tree", id });
  root.append(value === undefined ? h("span", { class: "j-none" }, "—") : node(value, 0, open));
  return root;
}
