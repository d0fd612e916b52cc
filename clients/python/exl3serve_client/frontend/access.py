"""Who may call the front end and what it did for them: the API key check (--api-key) and the
access log, as ASGI wrappers around the whole app (the generation endpoints included, which skip
FastAPI's own middleware stack: app.py's _App says why)."""

from __future__ import annotations

import hmac
import json
import os
import time
from typing import Any, Awaitable, Callable, Optional

from starlette.responses import JSONResponse

from .log_format import LogFormat, json_time
from .protocol import APIError

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

# The environment variable that gives the API key when --api-key does not (vLLM's is VLLM_API_KEY).
API_KEY_ENV = "EXL3SERVE_API_KEY"


def header(scope: Any, name: bytes) -> Optional[bytes]:
    """A request header's value (name in lower case, as ASGI gives them); None if absent."""
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def needs_key(path: str) -> bool:
    """The API's routes; /health, /metrics and the docs stay open (as vLLM keeps them)."""
    return path.startswith("/v1/") or path == "/v1" or path in ("/tokenize", "/detokenize")


class ApiKeyGate:
    """Answers 401 (OpenAI's error body, code invalid_api_key) to a request of the API's routes
    without `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.want = b"Bearer " + key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            got = header(scope, b"authorization") or b""
            if not hmac.compare_digest(got, self.want):
                err = APIError(401, "Incorrect API key provided: send it as "
                               "'Authorization: Bearer KEY'", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLogWriter:
    """Writes the access log's lines to stderr, each in one write: `logging` took about three
    times the CPU per line (its record, formatter and lock), on every request of the hot path.
    As text (a timestamp, then the line) or, with LogFormat.JSON, one JSON object per line."""

    def __init__(self, fd: int = 2, fmt: LogFormat = LogFormat.TEXT) -> None:
        self.fd = fd
        self.fmt = fmt
        self._second = -1
        self._stamp = ""

    def request(self, client: str, method: str, target: str, http_version: str, status: int,
                ms: float, request_id: str, client_gone: bool) -> None:
        """One answered request's line."""
        if self.fmt is LogFormat.JSON:
            self.out(json.dumps({"time": json_time(time.time()), "type": "access",
                                  "client": client, "method": method, "path": target,
                                  "http_version": http_version, "status": status,
                                  "duration_ms": round(ms, 1), "request_id": request_id or None,
                                  "client_disconnected": client_gone}, ensure_ascii=False))
            return
        note = " (client disconnected)" if client_gone else ""
        self.write(f'{client} - "{method} {target} HTTP/{http_version}" {status} {ms:.1f}ms '
                   f'{request_id or "-"}{note}')

    def write(self, line: str) -> None:
        """A text line, after the time."""
        now = time.time()
        second = int(now)
        if second != self._second:  # the timestamp's text, made once a second
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        self.out(f"{self._stamp}.{int((now - second) * 1000):03d} {line}")

    def out(self, line: str) -> None:
        """A line as it is."""
        try:
            os.write(self.fd, (line + "\n").encode("utf-8", "replace"))
        except OSError:  # stderr gone: the answer matters more than its log line
            pass


class AccessLog:
    """One line per HTTP request once it is answered: client, request line, status, milliseconds,
    the request id (the response's X-Request-Id, else the request's). A client that goes away before the answer's end
    is the line's status 499 and says so: no other line, no traceback."""

    def __init__(self, app: ASGIApp, writer: Optional[AccessLogWriter] = None) -> None:
        self.app = app
        self.writer = writer or AccessLogWriter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 0
        rid = header(scope, b"x-request-id") or b""  # the answer's, once it has one
        ended = False         # the answer's last body message was sent
        gone = False          # the client disconnected before that

        async def receive_seen() -> Any:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not ended:
                gone = True
            return message

        async def send_seen(message: Any) -> None:
            nonlocal status, rid, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                for k, v in message.get("headers", ()):
                    if k.lower() == b"x-request-id":
                        rid = v
            elif not message.get("more_body", False):
                ended = True
            await send(message)

        failed = False
        try:
            await self.app(scope, receive_seen, send_seen)
        except BaseException:
            failed = True
            raise
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            query = scope.get("query_string") or b""
            target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
            shown = 499 if gone else (500 if failed and not status else status)
            self.writer.request(who, scope["method"], target, scope.get("http_version", "1.1"),
                                shown, (time.monotonic() - started) * 1e3,
                                rid.decode("latin-1"), gone)
