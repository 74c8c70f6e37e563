// The UI's calls to /ui/api: JSON in and out, the bearer token when one is set.
const TOKEN_KEY = "stepstream-token";

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

// A link may carry the token in its fragment (#token=...): it never reaches a server
// log; it is kept for this tab only and taken out of the address bar.
export function takeTokenFromAddress() {
  const match = location.hash.match(/^#token=([^&]*)/);
  if (match) {
    setToken(decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + "#/");
  }
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export function hasToken() {
  return Boolean(sessionStorage.getItem(TOKEN_KEY));
}

export async function api(path, { method = "GET", body } = {}) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, "ConnectionFailed", `cannot reach the stepstream server (${err.message}); is it running?`);
  }
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    const error = (data && data.error) || {};
    throw new ApiError(response.status, error.type || `HTTP ${response.status}`, error.message || response.statusText);
  }
  return data;
}
