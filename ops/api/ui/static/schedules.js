// The Schedules page (#/schedules): every schedule with its spec, next run, last
// instance and skipped slots, and buttons to pause, resume, trigger or delete it.
// It reads /ui/api/schedules, which covers the whole deployment, and refreshes itself.
import { api } from "./api.js";
import { h, when } from "./dom.js";

const POLL_MS = 2000;

function instanceLink(id) {
  return id ? h("a", { href: `#/i/${encodeURIComponent(id)}` }, id) : "—";
}

function control(name, action, label, refresh, status) {
  return h("button", { type: "button", class: action === "delete" ? "danger" : "button secondary",
    "data-action": action, "aria-label": `${label} schedule ${name}`,
    onclick: async () => {
      if (action === "delete" && !confirm(`Delete schedule ${name}? Instances it started go on.`)) return;
      try {
        await api(`/ui/api/schedules/${encodeURIComponent(name)}/${action}`, { method: "POST", body: {} });
        status.textContent = `${label}: ${name}`;
      } catch (err) {
        status.textContent = `${label} ${name} failed: ${err.message}`;
      }
      await refresh();
    } }, label);
}

// Its instance ended (cancelled, failed): it runs no slot; creating it again restarts it.
function ended(s) {
  return s.status !== undefined && !["pending", "running"].includes(s.status);
}

function actions(s, refresh, status) {
  if (ended(s)) return [control(s.name, "delete", "Delete", refresh, status)];
  return [
    s.paused ? control(s.name, "resume", "Resume", refresh, status) : control(s.name, "pause", "Pause", refresh, status),
    control(s.name, "trigger", "Trigger", refresh, status),
    control(s.name, "delete", "Delete", refresh, status)];
}

function row(s, refresh, status) {
  return h("tr", { "data-schedule": s.name },
    h("th", { scope: "row" }, s.name),
    h("td", {}, s.workflow),
    h("td", {}, s.spec),
    h("td", ended(s) ? { title: "runs no more; stepstream schedule create starts it again" } : {},
      ended(s) ? s.status : s.paused ? "paused" : "active"),
    h("td", {}, s.next_run_at ? h("time", { datetime: s.next_run_at, title: s.next_run_at }, when(s.next_run_at)) : "—"),
    h("td", {}, instanceLink(s.last_instance_id)),
    h("td", { title: `${s.skipped_catchup} past the catch-up window, ${s.skipped_overlap} by overlap` }, String(s.skipped)),
    h("td", { class: "actions" }, ...actions(s, refresh, status)));
}

export async function schedulesPage(main) {
  const status = h("p", { role: "status", class: "status-line" });
  const body = h("tbody", {});
  const caption = h("caption", {});
  const table = h("table", { class: "data", id: "schedules" }, caption,
    h("thead", {}, h("tr", {}, ...["Schedule", "Workflow", "Spec", "State", "Next run", "Last instance", "Skipped", "Actions"]
      .map((n) => h("th", { scope: "col" }, n)))),
    body);
  async function refresh() {
    const data = await api("/ui/api/schedules");
    caption.textContent = data.schedules.length ? `${data.schedules.length} schedules` : "No schedules (stepstream schedule create makes one)";
    body.replaceChildren(...data.schedules.map((s) => row(s, refresh, status)));
  }
  await refresh();
  main.replaceChildren(h("h1", { tabindex: "-1" }, "Schedules"), status, h("div", { class: "scroll" }, table));
  const timer = setInterval(() => refresh().catch((err) => { status.textContent = err.message; }), POLL_MS);
  return () => clearInterval(timer);
}
