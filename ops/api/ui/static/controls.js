// The controls of an instance page. CONTROLS says which statuses allow each action (one
// line per action); a control is enabled only then, and otherwise disabled with a title
// saying why. The server still decides, and its refusal shows in the notice.
import { h } from "./dom.js";
import { FINISHED } from "./parts.js";

const LIVE = ["pending", "running", "paused"];

// action: the path under /ui/api/instances/<id>/; form: "button" (no input), "reason"
// (beside the Reason field, sends {reason}), "event" (the event form).
export const CONTROLS = [
  { action: "pause", label: "Pause", allowed: ["pending", "running"], form: "button" },
  { action: "resume", label: "Resume", allowed: ["paused"], form: "button" },
  { action: "cancel", label: "Cancel instance", allowed: LIVE, form: "reason", danger: true },
  { action: "terminate", label: "Terminate", allowed: LIVE, form: "reason", danger: true },
  { action: "events", label: "Send event", allowed: LIVE, form: "event" },
];

function either(words) {
  return words.length > 1 ? `${words.slice(0, -1).join(", ")} or ${words.at(-1)}` : words[0];
}

export function whyNot(control, status) {
  if (control.allowed.includes(status)) return "";
  const now = FINISHED.has(status) ? `it has finished (${status})` : `it is ${status}`;
  return `${control.label} works on ${either(control.allowed)} instances; ${now}.`;
}

// send(action, body, doneText) posts a control; say(text, isError) shows a notice;
// awaited(name) tells whether the instance waits for that event now.
export function controlsSection({ send, say, awaited, notice }) {
  const buttons = new Map(); // action -> its button
  const fields = []; // inputs enabled while any control of their form is
  const reason = h("input", { id: "c-reason", autocomplete: "off" });
  const eventName = h("input", { id: "c-event", list: "c-event-names", required: true, autocomplete: "off" });
  const events = h("datalist", { id: "c-event-names" });
  const payload = h("textarea", { id: "c-payload", rows: 3, spellcheck: "false", placeholder: '{"approved": true}' });
  const button = (control, type = "button", onclick = undefined) => {
    const el = h("button", { type, id: `c-${control.action}`, class: control.danger ? "danger" : false, onclick }, control.label);
    buttons.set(control.action, el);
    return el;
  };
  const of = (form) => CONTROLS.filter((c) => c.form === form);

  const plain = h("div", { class: "row" }, ...of("button").map((c) =>
    button(c, "button", () => send(c.action, {}, `${c.label} sent.`))));
  const withReason = h("form", { class: "row", onsubmit: (e) => e.preventDefault() },
    h("div", { class: "field" }, h("label", { for: "c-reason" }, "Reason"), reason),
    ...of("reason").map((c) => button(c, "button", () =>
      send(c.action, { reason: reason.value }, `${c.label.split(" ")[0]} sent.`))));
  fields.push([reason, of("reason")]);

  const eventForm = h("form", { class: "row", novalidate: true, onsubmit: (e) => {
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
    send("events", value === undefined ? { name } : { name, payload: value },
      awaited(name) ? `Event "${name}" sent.` : `Event "${name}" sent; nothing waits for it now, so the instance keeps it until it does.`);
  } },
  h("div", { class: "field" }, h("label", { for: "c-event" }, "Event name"), eventName, events),
  h("div", { class: "field grow" }, h("label", { for: "c-payload" }, "Payload (JSON)"), payload),
  ...of("event").map((c) => button(c, "submit")));
  fields.push([eventName, of("event")], [payload, of("event")]);

  const section = h("section", { class: "controls", "aria-labelledby": "controls-h" },
    h("h2", { id: "controls-h" }, "Controls"), plain, withReason, eventForm, notice);

  // Called with each new status: enable what it allows, say why the rest is not.
  function update(status) {
    for (const control of CONTROLS) {
      const el = buttons.get(control.action);
      const why = whyNot(control, status.status);
      el.disabled = Boolean(why);
      if (why) el.title = why;
      else el.removeAttribute("title");
    }
    for (const [input, controls] of fields) {
      input.disabled = controls.every((c) => !c.allowed.includes(status.status));
    }
    events.replaceChildren(...status.waits.filter((w) => w.event).map((w) => h("option", { value: w.event })));
  }
  return { section, update };
}
