"""One redaction for everything flashdraft prints or writes: the user:password part of any URL.

    redact("http://alice:s3cret@gpu-a:8000/v1 refused") == "http://***@gpu-a:8000/v1 refused"

A password can reach flashdraft inside a store URL, `AWS_ENDPOINT_URL` or a `--base-url`, and from there any
error message. The CLI's consoles, its JSON output, `status` (and STATUS.md), generate's errors files and the
debug logs of `sync --verbose` all pass through `redact`; the session keys of the AWS chain are scrubbed from
those logs as well (`store.SecretRedactor`).
"""

from __future__ import annotations

import re

# scheme://userinfo@ — the userinfo has no '/', whitespace, quote or '@' (RFC 3986 §3.2.1)
USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"<>]+@")


def redact(text: str) -> str:
    return USERINFO.sub(r"\g<scheme>***@", text)
