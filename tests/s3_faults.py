"""A fault-injecting HTTP proxy in front of an S3 server, for tests: it answers chosen requests
``503 SlowDown``, drops connections before or after forwarding (the client never hears whether
its write landed), or goes down altogether, as a real endpoint does under load or in an outage."""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


@dataclass
class Request:
    number: int  # 1, 2, … in arrival order
    method: str
    path: str
    sent: int = 0  # body bytes, to the server
    received: int = 0  # body bytes, back
    agent: str = ""  # the client's User-Agent

    @property
    def client(self) -> str:
        """Which library sent it: boto3, pyarrow (the AWS C++ SDK) or deltalake (Rust object_store)."""
        agent = self.agent.lower()
        return "boto3" if "boto" in agent else "pyarrow" if "aws-sdk-cpp" in agent else "deltalake"

    @property
    def kind(self) -> str:
        """What S3 bills it as: GET, PUT, POST, HEAD, DELETE, or LIST (a GET listing a prefix)."""
        return "LIST" if self.method == "GET" and "list-type=" in self.path else self.method


# what to do with a request: "forward", "slow_down" (503), "drop" (close before forwarding),
# "drop_after" (forward, then close without answering)
Rule = Callable[[Request], str]


class FaultyProxy:
    """``url`` reaches ``upstream`` through the proxy; ``rule`` decides each request's fate."""

    def __init__(self, upstream: str, rule: Rule | None = None):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rule: Rule = rule or (lambda request: "forward")
        self.seen: list[tuple[Request, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    request = Request(
                        len(proxy.seen) + 1,
                        self.command,
                        self.path,
                        len(body),
                        agent=self.headers.get("User-Agent", ""),
                    )
                    fate = proxy.rule(request)
                    proxy.seen.append((request, fate))
                if fate == "drop":
                    return self._hang_up()
                if fate == "slow_down":
                    return self._answer(503, [("Content-Type", "application/xml")], SLOW_DOWN)
                status, headers, data = self._forward(body)
                request.received = len(data)
                if fate == "drop_after":
                    return self._hang_up()
                self._answer(status, headers, data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return b"".join(chunks)
                        chunks.append(chunk)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                connection.request(self.command, self.path, body=body or None, headers=headers)
                reply = connection.getresponse()
                data = reply.read()
                kept = [(k, v) for k, v in reply.getheaders() if k.lower() not in _HOP_BY_HOP]
                connection.close()
                return reply.status, kept, data

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response_only(status)
                for key, value in headers:
                    if key.lower() != "content-length" or self.command == "HEAD":
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _hang_up(self) -> None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that hangs up mid-answer (it timed out, or read what it needed) is no news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, fate: str) -> int:
        with self._lock:
            return sum(1 for _, f in self.seen if f == fate)

    def take(self) -> list[Request]:
        """The requests seen since the last ``take``."""
        with self._lock:
            seen, self.seen = [r for r, _ in self.seen], []
        return seen

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
