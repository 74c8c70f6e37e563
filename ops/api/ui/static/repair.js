// Reset, fork and retry on the instance page (docs/operations-on-instances.md): the
// keys to choose from are those of the timeline's steps, sleeps and waits, which are
// what still counts of the instance's history. Each POSTs to /ui/api/instances/{id}/...
import { api } from "./api.js";
import { h } from "./dom.js";

const KINDS = new Set(["step", "sleep", "wait"]);

export function repairControls(path, say, refresh) {
  const key = h("select", { id: "r-key" });
  const reason = h("input", { id: "r-reason", autocomplete: "off" });
  const forkId = h("input", { id: "r-fork-id", autocomplete: "off", placeholder: "a new id if empty" });
  const run = async (control, body, done) => {
    try {
      const answer = await api(`${path}/${control}`, { method: "POST", body });
      say(done(answer));
      await refresh();
    } catch (err) {
      say(`${err.type}: ${err.message}`, true);
    }
  };
  const chosen = (e) => {
    e.preventDefault();
    if (!key.value) {
      say("This instance has no step, sleep or wait to go back to yet.", true);
      return null;
    }
    return key.value;
  };
  const retry = h("button", {
    type: "button", id: "r-retry",
    onclick: () => run("retry", { reason: reason.value }, () => "Retry sent: it goes on from its failed step."),
  }, "Retry");
  const retryRow = h("div", { class: "row" }, retry);
  const section = h("section", { class: "controls repair", "aria-labelledby": "repair-h" },
    h("h2", { id: "repair-h" }, "Reset, fork, retry"),
    retryRow,
    h("form", { class: "row", onsubmit: (e) => {
      const to = chosen(e);
      if (to) run("reset", { to, reason: reason.value }, () => `Reset sent: it goes on from just before ${to}.`);
    } },
    h("div", { class: "field" }, h("label", { for: "r-key" }, "Go on from just before"), key),
    h("div", { class: "field" }, h("label", { for: "r-reason" }, "Note for the history"), reason),
    h("button", { type: "submit", id: "r-reset", class: "danger" }, "Reset")),
    h("form", { class: "row", onsubmit: (e) => {
      const to = chosen(e);
      if (!to) return;
      const body = forkId.value.trim() ? { to, instance_id: forkId.value.trim() } : { to };
      run("fork", body, (answer) => h("span", {}, "Forked: ",
        h("a", { href: `#/i/${encodeURIComponent(answer.instance_id)}`, id: "r-forked" }, answer.instance_id)));
    } },
    h("div", { class: "field" }, h("label", { for: "r-fork-id" }, "New instance id"), forkId),
    h("button", { type: "submit", id: "r-fork" }, "Fork from the same key")));
  // Called on every refresh: Retry only for a failed instance; the choice of key kept.
  section.update = (latest) => {
    retryRow.style.display = latest.status.status === "failed" ? "" : "none";  // .row is flex: not [hidden]
    const before = key.value;
    const names = [...new Set(latest.timeline.filter((r) => KINDS.has(r.kind)).map((r) => r.name))];
    key.replaceChildren(...names.map((name) => h("option", { value: name }, name)));
    if (names.includes(before)) key.value = before;
  };
  return section;
}
