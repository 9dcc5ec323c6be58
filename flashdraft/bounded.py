"""Bounded reads: the one way a check (preflight, status, a prompt file) opens a file or asks an endpoint, so that
none of them can hang or fill memory, whatever sits at the path or answers at the URL.

    with open_regular("prompts.jsonl") as f: ...          # a FIFO, /dev/zero, a socket: refused at once, not read
    read_small(lock_file, 4096, follow_links=False)        # at most `limit` bytes
    get_json("http://gpu-a:8000/v1/models", deadline_s=5)  # the whole exchange within the deadline, redirects bounded

- **Files** are opened non-blocking (opening a FIFO with no writer would wait forever) and used only when they are
  regular files; a character device such as /dev/zero would otherwise be one endless line.
- **Endpoints**: the deadline is a wall clock over the whole exchange (connect, status line, headers, every byte of
  the body), enforced by a timer that shuts the socket when it passes: a server that trickles its headers or body
  one byte every 2 s is cut off at the deadline, not after a timeout per read; the body is capped; credentials
  (a bearer key, `user:password@` in the URL, sent as HTTP basic auth as curl does) are sent only to the URL's own
  origin: a redirect to another origin is not followed. urllib rather than httpx/requests: the check is one GET,
  and the deadline and redirect rules are easier to see written out than configured.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from flashdraft.errors import BadInput


class NotRegular(BadInput):
    """A path a check would read is a FIFO, a device, a socket or a directory: reading it could block forever."""


def open_regular(path: str | Path, *, follow_links: bool = True) -> IO[bytes]:
    """`path` opened for reading in binary, after checking it is a regular file; never blocks on opening."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
        raise NotRegular(f"{path} is {what}, not a regular file: it is not read")
    os.set_blocking(fd, True)  # a regular file: blocking reads, as usual
    return os.fdopen(fd, "rb")


def read_small(path: str | Path, limit: int, *, follow_links: bool = True) -> bytes:
    """The bytes of a small regular file (a lock record, a marker); ValueError when it holds more than `limit`."""
    with open_regular(path, follow_links=follow_links) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


# ---------------------------------------------------------------------------------------------- endpoints


class EndpointError(ValueError):
    """The endpoint did not answer as asked within the deadline: the message says how."""


def split_credentials(url: str) -> tuple[str, str | None]:
    """(the URL without `user:password@`, the Authorization header those make, or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    return urlunsplit(parts._replace(netloc=netloc)), "Basic " + base64.b64encode(pair.encode()).decode()


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


MAX_REDIRECTS = 3


def get_json(url: str, *, bearer: str | None = None, deadline_s: float = 5.0, limit: int = 1 << 20) -> Any:
    """GET `url` and parse its JSON body, all within `deadline_s` seconds and `limit` bytes. Credentials go only to
    the URL's origin; a redirect elsewhere is an error naming where it pointed (without following it)."""
    status, body = get(url, bearer=bearer, deadline_s=deadline_s, limit=limit)
    if status >= 400:
        raise HTTPStatus(status)
    try:
        return json.loads(body)
    except ValueError:
        raise EndpointError("did not answer with JSON") from None


def get(url: str, *, bearer: str | None = None, deadline_s: float = 5.0, limit: int = 1 << 20) -> tuple[int, bytes]:
    """GET `url`: (its status, its body), within `deadline_s` and `limit` bytes, redirects on its origin only."""
    import http.client
    from urllib.parse import urljoin

    url, basic = split_credentials(url)
    authorization = basic or (f"Bearer {bearer}" if bearer else None)
    origin, deadline = _origin(url), time.monotonic() + deadline_s
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise EndpointError(f"{parts.scheme or 'no'} scheme: an endpoint URL is http:// or https://")
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname or "", parts.port, timeout=_left(deadline, deadline_s))
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Accept": "application/json"} | ({"Authorization": authorization} if authorization else {})
        status, location, body = exchange(connection, "GET", path, headers=headers, deadline_s=deadline_s,
                                          deadline=deadline, limit=limit)
        if status in (301, 302, 303, 307, 308) and location:
            target = urljoin(url, location)
            if _origin(target) != origin:
                raise EndpointError(f"GET {urlsplit(url).path} answered HTTP {status}, a redirect to another origin "
                                    f"({_origin_text(target)}); not followed, so no credentials reach it: point the "
                                    "base URL at the server itself")
            url = target
            continue
        return status, body
    raise EndpointError(f"more than {MAX_REDIRECTS} redirects")


def exchange(connection, method: str, path: str, *, headers: dict[str, str], body: bytes | None = None,
             deadline_s: float, deadline: float | None = None, limit: int) -> tuple[int, str | None, bytes]:
    """One request on `connection` (an http.client connection, not yet connected): (status, Location, body). The
    deadline is a wall clock over the whole exchange — connect, status line, headers, every byte of the body —
    enforced from outside the reads: a timer shuts the socket down when it passes, so a server that trickles its
    headers a byte at a time is cut off there, not after a per-read timeout per byte."""
    import http.client
    import socket
    import threading

    deadline = deadline if deadline is not None else time.monotonic() + deadline_s
    cut = threading.Event()

    def cut_off() -> None:
        cut.set()
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut_off)
    timer.daemon = True
    timer.start()
    try:
        connection.timeout = _left(deadline, deadline_s)
        connection.request(method, path, body=body, headers=headers)
        if cut.is_set():  # passed while connecting, before there was a socket to shut
            raise TimeoutError
        response = connection.getresponse()
        data = _read_body(response, connection, deadline, deadline_s, limit)
        if cut.is_set():  # the socket was shut under the last read: what came is not the whole answer
            raise TimeoutError
        return response.status, response.getheader("Location"), data
    except (TimeoutError, OSError, http.client.HTTPException) as e:
        if cut.is_set() or isinstance(e, TimeoutError):
            raise EndpointError(f"does not answer within {deadline_s:.0f} s (no complete answer)") from None
        raise EndpointError(f"does not answer ({getattr(e, 'reason', e) or type(e).__name__})") from None
    finally:
        timer.cancel()
        connection.close()


class HTTPStatus(EndpointError):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


def _origin_text(url: str) -> str:
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}"


def _left(deadline: float, deadline_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no complete answer within {deadline_s:.0f} s")
    return left


def _read_body(response, connection, deadline: float, deadline_s: float, limit: int) -> bytes:
    """The body, read in pieces with the socket's timeout set to what is left of the deadline before each."""
    chunks, size = [], 0
    while True:
        if connection.sock is not None:
            connection.sock.settimeout(_left(deadline, deadline_s))
        chunk = response.read1(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise EndpointError(f"answered more than {limit:,} bytes")
        _left(deadline, deadline_s)
