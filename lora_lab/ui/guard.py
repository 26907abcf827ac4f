"""What stands between the network and the page, with nothing imported from gradio: the Host
and Origin check of every request (DNS rebinding, cross-site posts), the refusal of uploads
(the page has no file field), where the token comes from, the pause after wrong tokens, and
the login link `lora-lab ui` prints."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

from ..errors import LoraLabError
from .form import LOCAL_HOSTS, token_matches

TOKEN_ENV = "LORA_LAB_UI_TOKEN"
"""The environment variable a token is read from (argv is visible to every user in `ps`)."""
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
MAX_UPLOAD = "1mb"
"""gradio's upload limit; the page's own upload route is refused anyway (HostGuard)."""
WRONG_TOKENS_PER_MINUTE = 5
LINK_USER = "lora-lab"
"""The user name a login through the printed link logs in as (the page asks for none)."""


def served_names(host: str) -> set[str]:
    """The Host names the page answers to: loopback names on a loopback address, else the
    --host value (and loopback names, for a browser on the same machine)."""
    names = {"127.0.0.1", "localhost", "::1", "[::1]"}
    if host in ("0.0.0.0", "::"):  # every address of this machine: its own names and addresses
        with contextlib.suppress(OSError):
            name, aliases, addresses = socket.gethostbyname_ex(socket.gethostname())
            names |= {name.lower(), *map(str.lower, aliases), *addresses, socket.gethostname().lower()}
    elif host not in LOCAL_HOSTS:
        names.add(f"[{host.lower()}]" if ":" in host else host.lower())
    return names


def _name_of(authority: str) -> str:
    """'Example.org:7860' -> 'example.org'; '[::1]:7860' -> '[::1]'."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[: authority.find("]") + 1]
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


class HostGuard:
    """ASGI middleware (on the app gradio builds, through launch's app_kwargs): a request whose
    Host is not a name the page was started for, or a state-changing one whose Origin is
    another site, is answered 403 before gradio sees it; so is any upload."""

    def __init__(self, app, names: set[str]):
        self.app, self.names = app, {n.lower() for n in names}

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        reason = self.refusal(scope)
        if reason is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = f"refused: {reason}\n".encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope) -> str | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if _name_of(headers.get("host", "")) not in self.names:
            return "this page does not serve that host name"
        method = scope.get("method", "GET")
        if scope["type"] == "websocket" or method not in SAFE_METHODS:
            origin = headers.get("origin")
            if origin is not None and _name_of(urlsplit(origin).netloc) not in self.names:
                return "a request from another site"
        if method == "POST" and scope.get("path", "").rstrip("/").endswith("/upload"):
            return "the page takes no uploads"
        return None


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The token: from --token-file, else the environment variable LORA_LAB_UI_TOKEN, else
    --token (deprecated: visible in `ps`)."""
    if token_file:
        try:
            text = Path(token_file).expanduser().read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise LoraLabError(f"--token-file {token_file}: cannot read it ({exc.strerror}).") from None
        if not text:
            raise LoraLabError(f"--token-file {token_file}: the file is empty; write the token into it.")
        return text
    return os.environ.get(TOKEN_ENV) or token or None


class TokenCheck:
    """gradio's auth function: the token compared in constant time, and after
    WRONG_TOKENS_PER_MINUTE wrong tries in a minute every try is refused until the minute
    has passed (the right token too), so a token cannot be guessed at speed."""

    def __init__(self, token: str, per_minute: int = WRONG_TOKENS_PER_MINUTE, clock=time.monotonic):
        self.token, self.per_minute, self.clock = token, per_minute, clock
        self.wrong: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, user: str, given: str) -> bool:
        with self.lock:
            now = self.clock()
            self.wrong = [t for t in self.wrong if now - t < 60]
            if len(self.wrong) >= self.per_minute:
                return False
            if token_matches(given, self.token):
                return True
            self.wrong.append(now)
            return False


def page_address(host: str, port: int) -> str:
    """The page's address as a browser opens it (this machine's name for a wildcard host)."""
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def login_link(host: str, port: int, token: str) -> str:
    """The address that opens the page logged in (TokenLink), as `lora-lab ui` prints it."""
    return f"{page_address(host, port)}?{urlencode({'token': token})}"


class TokenLink:
    """ASGI middleware: `GET /?token=T` logs the browser in exactly as gradio's login form
    would (T is checked by the same TokenCheck, a wrong one counts as a wrong try) and sends it
    on to the page, whose address no longer holds the token; a wrong token lands on the login
    page. This is the link `lora-lab ui` prints, as Jupyter does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        given = self.given_token(scope)
        if given is None:
            return await self.app(scope, receive, send)
        cookies = await self.login(scope, receive, given)
        headers = [(b"location", b"./"), (b"referrer-policy", b"no-referrer"), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": 303, "headers": headers + cookies})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    def given_token(scope) -> str | None:
        if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") != "/":
            return None
        values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
        return values[-1] if values else None

    async def login(self, scope, receive, given: str) -> list[tuple[bytes, bytes]]:
        """gradio's own /login, called inside this request: the cookies it sets, or none."""
        body = urlencode({"username": LINK_USER, "password": given}).encode()
        kept = [(k, v) for k, v in scope.get("headers", []) if k.lower() in (b"host", b"user-agent")]
        form = [(b"content-type", b"application/x-www-form-urlencoded"), (b"content-length", b"%d" % len(body))]
        login_scope = {**scope, "method": "POST", "path": "/login", "raw_path": b"/login", "query_string": b""}
        login_scope["headers"] = kept + form
        answer: dict = {}

        async def request():
            if "sent" in answer:
                return await receive()
            answer["sent"] = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def keep(message):
            if message["type"] == "http.response.start":
                answer["status"], answer["headers"] = message["status"], message.get("headers", [])

        await self.app(login_scope, request, keep)
        if answer.get("status") != 200:
            return []
        return [(k, v) for k, v in answer["headers"] if k.lower() == b"set-cookie"]
