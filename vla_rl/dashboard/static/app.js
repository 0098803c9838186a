// Placeholder frontend: the token comes from the URL fragment (#token=...) or localStorage, and is sent
// as an Authorization header (never a cookie).
const params = new URLSearchParams(location.hash.slice(1));
if (params.get("token")) { localStorage.setItem("vla-rl-token", params.get("token")); history.replaceState(null, "", location.pathname); }
const token = localStorage.getItem("vla-rl-token") || "";
const api = (path) => fetch(`/api/v1${path}`, { headers: { Authorization: `Bearer ${token}` } }).then((r) => r.json());
const app = document.getElementById("app");
Promise.all([api("/health"), api("/session")]).then(([health, session]) => {
  app.textContent = JSON.stringify({ health, session }, null, 2);
});
