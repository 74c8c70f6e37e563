// Dark or light: the choice kept in localStorage, else the system's (prefers-color-scheme).
// Loaded as a classic script in <head>, so the theme is set before the page is painted.
(function () {
  const KEY = "stepstream-theme";
  const root = document.documentElement;
  const stored = () => {
    try {
      return localStorage.getItem(KEY);
    } catch {
      return null; // storage refused (a privacy setting): follow the system
    }
  };
  const system = () => (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
  const apply = (theme) => {
    root.dataset.theme = theme;
    const button = document.getElementById("theme-toggle");
    if (button) {
      button.setAttribute("aria-pressed", String(theme === "dark"));
      button.textContent = theme === "dark" ? "Light mode" : "Dark mode";
      button.title = `Switch to ${theme === "dark" ? "light" : "dark"} colours (remembered in this browser)`;
    }
  };
  apply(stored() || system());
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => apply(stored() || system()));
  document.addEventListener("DOMContentLoaded", () => {
    const button = document.getElementById("theme-toggle");
    apply(root.dataset.theme);
    button.addEventListener("click", () => {
      const next = root.dataset.theme === "dark" ? "light" : "dark";
      try {
        localStorage.setItem(KEY, next);
      } catch {
        // not remembered, but switched for this page
      }
      apply(next);
    });
  });
})();
