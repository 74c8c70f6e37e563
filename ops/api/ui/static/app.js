// The UI's router: #/ (instances), #/i/<id> (one instance), #/definitions. Each route
// renders into <main>; a 401 from the API shows the token form instead.
import { ApiError, hasToken, setToken, takeTokenFromAddress } from "./api.js";
import { h } from "./dom.js";
import { instancePage } from "./instance.js";
import { definitionsPage, listPage } from "./pages.js";
import { schedulesPage } from "./schedules.js";

const main = document.getElementById("main");
let current = null; // the rendered route's cleanup (a live page stops polling)

function route() {
  const hash = location.hash || "#/";
  const [path, query = ""] = hash.slice(1).split("?");
  const params = new URLSearchParams(query);
  if (path.startsWith("/i/")) return { name: "instance", id: decodeURIComponent(path.slice(3)), params };
  if (path === "/definitions") return { name: "definitions", params };
  if (path === "/schedules") return { name: "schedules", params };
  return { name: "instances", params };
}

export function showError(err, where = main) {
  where.replaceChildren(h("div", { class: "error", role: "alert" },
    h("strong", {}, err.type || "Error"), ": ", err.message));
}

function tokenForm(reason) {
  const input = h("input", { id: "token", type: "password", autocomplete: "current-password", required: true });
  const form = h("form", { class: "token-form", onsubmit: (e) => {
    e.preventDefault();
    setToken(input.value.trim());
    render();
  } },
  h("h1", { tabindex: "-1" }, "API token needed"),
  h("p", {}, reason),
  h("p", {}, "Give the token the server was started with (STEPSTREAM_API_TOKEN or --api-token). It is kept for this browser tab only."),
  h("label", { for: "token" }, "API token"), input,
  h("button", { type: "submit" }, "Use token"));
  main.replaceChildren(form);
  input.focus();
}

async function render() {
  if (current) current();
  current = null;
  const r = route();
  for (const link of document.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === (r.name === "instance" ? "instances" : r.name)) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  try {
    if (r.name === "instance") current = await instancePage(main, r.id);
    else if (r.name === "definitions") await definitionsPage(main);
    else if (r.name === "schedules") current = await schedulesPage(main);
    else await listPage(main, r.params);
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      tokenForm(hasToken() ? "The token given is not this server's." : "This stepstream server needs an API token.");
      if (hasToken()) setToken(null);
      return;
    }
    showError(err);
  }
}

takeTokenFromAddress();
window.addEventListener("hashchange", () => render().then(() => main.querySelector("h1")?.focus()));
render();
