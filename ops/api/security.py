"""Who may use the HTTP API of ``stepstream dev`` and of a worker.

- A bearer token (``STEPSTREAM_API_TOKEN``, ``--api-token``): every request but the
  probes (``/healthz``, ``/readyz``) and the web UI's page and static files must carry
  ``Authorization: Bearer <token>``, the websocket upgrade of ``/v1/session``, ``/metrics``
  and the UI's JSON included. Compared in constant time.
- A server bound beyond loopback refuses to start without a token, unless ``--insecure``.
- Cross-site requests are refused: an ``Origin`` that is not the server's own (403: its
  scheme too, so a plain-http server takes only ``http://`` origins and an https one only
  ``https://``; a page served over one cannot call the other), a
  ``Host`` that is not a loopback name, an IP address, the bound or advertised host, this
  machine's name or an allowed host (``--allowed-host``, ``STEPSTREAM_ALLOWED_HOSTS``; ``*``
  allows any) (403: DNS rebinding), and a POST whose body is not ``application/json``
  (or, on the internal routes only, ``RECORDS_TYPE``: the engine processes' forwarded
  records) (415): a browser cannot send either cross-site without asking first.
- Behind a proxy that terminates TLS (an Ingress), browsers send the proxy's origin
  (``https://flows.example.com``) to a plain-http server: ``--public-url``
  (``STEPSTREAM_PUBLIC_URL``, comma-separated for several) names the URLs the server is
  reached at, whose origins are its own too and whose hosts are allowed in ``Host``.
- Optional TLS (``--tls-cert``, ``--tls-key``).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from stepstream.engine.errors import StepstreamError
from stepstream.ops.api.ui.routes import STATIC_PREFIX, UI_FILES, UI_PATHS

# Forwarded log records, between the engine processes of ``stepstream dev --processes``:
# taken only on their internal routes.
RECORDS_TYPE = "application/vnd.stepstream.records"
INTERNAL_PREFIX = "/internal/"

TOKEN_ENV = "STEPSTREAM_API_TOKEN"
ALLOWED_HOSTS_ENV = "STEPSTREAM_ALLOWED_HOSTS"
PUBLIC_URL_ENV = "STEPSTREAM_PUBLIC_URL"
_TLS_CERT_ENV = "STEPSTREAM_TLS_CERT"
_TLS_KEY_ENV = "STEPSTREAM_TLS_KEY"
_INSECURE_ENV = "STEPSTREAM_INSECURE"
# Paths served to anyone: Kubernetes probes carry no token, and a browser cannot send one
# when it opens the web UI (its page and files hold no data; the JSON it reads needs the
# token, which the page asks for).
_OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", *UI_PATHS, *(STATIC_PREFIX + name for name in UI_FILES)}
)
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
# Scraped by Prometheus, which a refusal tells how to send the token.
METRICS_PATH = "/metrics"


class InsecureBind(StepstreamError):
    """The API would serve beyond loopback without a token."""


@dataclass(frozen=True)
class ApiSecurity:
    """The API's access settings; ``ApiSecurity.from_env(**flags)`` reads the
    ``STEPSTREAM_*`` variables and lets flags that are set win."""

    token: str | None = None
    # Serve beyond loopback without a token (a trusted network only).
    insecure: bool = False
    # Host names the API answers to besides loopback, IP addresses and its own names.
    allowed_hosts: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    # The URLs browsers reach the API at through a proxy (``https://flows.example.com``),
    # as origins: scheme://host[:port], the scheme's default port left out.
    public_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.token is not None and not _printable(self.token):
            raise StepstreamError(
                f"the API token holds spaces or characters outside printable ASCII; set "
                f"{TOKEN_ENV} / --api-token to a token such as the output of "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise StepstreamError(
                "TLS needs both --tls-cert and --tls-key (or STEPSTREAM_TLS_CERT and "
                "STEPSTREAM_TLS_KEY): a certificate chain and its private key, PEM files"
            )
        origins = tuple(dict.fromkeys(public_origin(url) for url in self.public_urls))
        object.__setattr__(self, "public_urls", origins)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        token: str | None = None,
        insecure: bool | None = None,
        allowed_hosts: Iterable[str] = (),
        tls_cert: str | None = None,
        tls_key: str | None = None,
        public_urls: Iterable[str] = (),
    ) -> ApiSecurity:
        env = os.environ if environ is None else environ
        hosts = [h.strip() for h in env.get(ALLOWED_HOSTS_ENV, "").split(",")]
        hosts.extend(h.strip() for h in allowed_hosts)
        urls = [u.strip() for u in env.get(PUBLIC_URL_ENV, "").split(",")]
        urls.extend(u.strip() for u in public_urls)
        return cls(
            token=token or env.get(TOKEN_ENV) or None,
            insecure=insecure
            if insecure is not None
            else env.get(_INSECURE_ENV, "").lower() in ("1", "true", "yes"),
            allowed_hosts=tuple(dict.fromkeys(_host_name(h) for h in hosts if h)),
            tls_cert=tls_cert or env.get(_TLS_CERT_ENV) or None,
            tls_key=tls_key or env.get(_TLS_KEY_ENV) or None,
            public_urls=tuple(u for u in urls if u),
        )

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def public_url(self) -> str | None:
        """The first URL browsers reach the API at through a proxy, if one is set."""
        return self.public_urls[0] if self.public_urls else None

    def check_bind(self, host: str) -> None:
        """Raise ``InsecureBind`` if serving on ``host`` would open the API beyond this
        machine to anyone who can reach it."""
        if self.token or self.insecure or is_loopback(host):
            return
        raise InsecureBind(
            f"refusing to serve the API on {host or 'every address'} without a token: anyone "
            f"who can reach it could start and cancel workflows. Set {TOKEN_ENV} (or pass "
            "--api-token) and give clients the same token, or bind to 127.0.0.1, or pass "
            "--insecure if every client of this network is trusted"
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise StepstreamError(
                f"cannot load the TLS certificate {self.tls_cert!r} with key "
                f"{self.tls_key!r}: {exc}; pass PEM files to --tls-cert and --tls-key"
            ) from None
        return context

    def guard(self, served_hosts: Iterable[str] = ()) -> Middleware:
        """The middleware that enforces these settings; ``served_hosts`` are the names the
        server is reached by (the bound host, the advertised URL's host)."""
        return _Guard(self, served_hosts).check


def _accepted_body(request: web.Request) -> bool:
    kind = request.content_type
    if kind == "application/json":
        return True
    return kind == RECORDS_TYPE and request.path.startswith(INTERNAL_PREFIX)


def public_origin(url: str) -> str:
    """``url`` (``--public-url``) as the origin a browser sends for pages under it:
    ``scheme://host[:port]``, lower case, the scheme's default port left out. Anything
    but an http(s) URL with a host is refused, saying what to give."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise StepstreamError(
            f"the public URL {url!r} is not an http(s) URL with a host; give --public-url "
            f"(or {PUBLIC_URL_ENV}) the address browsers open, as they see it, such as "
            "https://flows.example.com"
        )
    scheme = parts.scheme.lower()
    name = parts.hostname.lower().rstrip(".")
    host = f"[{name}]" if ":" in name else name
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(host: str) -> bool:
    name = _host_name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _Guard:
    def __init__(self, security: ApiSecurity, served_hosts: Iterable[str]) -> None:
        self._token = security.token.encode() if security.token else None
        self._scheme = security.scheme
        self._public = frozenset(security.public_urls)
        self._public_names = frozenset(
            _host_name(urlsplit(url).netloc) for url in security.public_urls
        )
        names = {_host_name(h) for h in (*served_hosts, *security.allowed_hosts)}
        names |= self._public_names
        if names & _WILDCARD_BINDS:
            names.add(_host_name(socket.gethostname()))
        self._any_host = "*" in names
        # "*.shop.example" (an Ingress host, say): any name below shop.example.
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*.") and len(n) > 2)
        self._names = frozenset(names - _WILDCARD_BINDS)

    @web.middleware
    async def check(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if host is not None and not self._host_allowed(host):
            return _refuse(
                403,
                "AccessDenied",
                f"Host {host!r} is not a name this stepstream API answers to (a defence "
                "against DNS rebinding); connect by the address it serves, or add the name "
                f"with --allowed-host or {ALLOWED_HOSTS_ENV}",
            )
        origin = request.headers.get("Origin")
        if origin is not None and not self._own_origin(origin, host):
            return _refuse(403, "AccessDenied", self._foreign_origin(origin, host))
        if self._token is not None and request.path not in _OPEN_PATHS:
            refusal = self._check_token(request.headers.get("Authorization"), request.path)
            if refusal is not None:
                return _refuse(401, "AccessDenied", refusal, {"WWW-Authenticate": "Bearer"})
        if request.method == "POST" and not _accepted_body(request):
            sent = request.headers.get("Content-Type")
            return _refuse(
                415,
                "UnsupportedMediaType",
                f"POST {request.path} takes a JSON body sent with Content-Type: "
                f"application/json; this one came with {sent or 'no Content-Type'} (a POST "
                "without a body says it too: curl -H 'Content-Type: application/json')",
            )
        return await handler(request)

    def _foreign_origin(self, origin: str, host: str | None) -> str:
        served = f"{self._scheme}://{host or '(no Host header)'}"
        said = (
            f"cross-site request refused: Origin {origin!r} is not this server ({served}"
            + (f", or its public URLs {', '.join(sorted(self._public))}" if self._public else "")
            + "); stepstream's API is not for other web sites, nor for pages served over "
            "another scheme."
        )
        if self._public:
            return said + " Open the UI at its public URL, or add this one with --public-url"
        return (
            f"{said} If browsers reach this server through a proxy at another URL (one that "
            f"terminates TLS, say), start it with --public-url URL or {PUBLIC_URL_ENV}"
        )

    def _own_origin(self, origin: str, host: str | None) -> bool:
        """The server's own origins: its public URLs', and the scheme it serves with the
        ``Host`` it was reached by, unless that is a public host (reached through the
        proxy, whose scheme is the public URL's: a plain-http page there is not ours)."""
        if self._public:
            try:
                if public_origin(origin) in self._public:
                    return True
            except StepstreamError:  # "null", or not a URL: no origin of ours
                return False
            if host is not None and _host_name(host) in self._public_names:
                return False
        return _same_origin(origin, host, self._scheme)

    def _host_allowed(self, header: str) -> bool:
        name = _host_name(header)
        if self._any_host or name in self._names or is_loopback(name):
            return True
        if self._suffixes and name.endswith(self._suffixes):
            return True
        try:
            ipaddress.ip_address(name)  # reached by address: no name to rebind
            return True
        except ValueError:
            return False

    def _check_token(self, header: str | None, path: str = "") -> str | None:
        assert self._token is not None
        scheme, _, given = (header or "").partition(" ")
        if header is None or scheme.lower() != "bearer" or not given.strip():
            if path == METRICS_PATH:  # asked by a scraper, not a client
                return (
                    "/metrics needs the API's bearer token (Authorization: Bearer TOKEN): "
                    "give it to Prometheus (a scrape config's authorization.credentials, "
                    "or the chart's ServiceMonitor, which sends it)"
                )
            return (
                "this stepstream API needs a bearer token (Authorization: Bearer TOKEN); pass "
                f"token= to Client.connect, or --token / {TOKEN_ENV} to the CLI"
            )
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return (
                "the bearer token is not this server's; use the token it was started with "
                f"({TOKEN_ENV} / --api-token of the server)"
            )
        return None


def _refuse(
    status: int, kind: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    body = {"error": {"type": kind, "message": message}}
    return web.json_response(body, status=status, headers=headers)


def _same_origin(origin: str, host: str | None, scheme: str) -> bool:
    """Whether ``Origin`` names this server: the scheme it serves (``scheme``), and the
    host and port the ``Host`` header names (a Host without a port is the scheme's
    default one)."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if host is None or parts.scheme != scheme or not parts.hostname:
        return False
    default = 443 if scheme == "https" else 80
    name, port = _split_host(host)
    if port is None:
        port = default
    return _host_name(parts.hostname) == name and (origin_port or default) == port


def _split_host(host: str) -> tuple[str, int | None]:
    try:
        parts = urlsplit(f"//{host.strip()}")
        return _host_name(parts.hostname or ""), parts.port
    except ValueError:
        return _host_name(host), None


def _host_name(host: str) -> str:
    """``host`` without port or brackets, lower case, no trailing dot."""
    text = host.strip()
    if text.startswith("[") and "]" in text:
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.lower().rstrip(".")


def _printable(token: str) -> bool:
    return bool(token) and token.isascii() and token.isprintable() and " " not in token
