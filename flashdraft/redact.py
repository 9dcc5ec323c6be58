"""One redaction for everything flashdraft prints or writes: the user:password part of any URL, and the value of
every secret the environment hands flashdraft (an API key a server echoes back in an error must not land in
errors.jsonl or on the terminal).

    redact("http://alice:s3cret@gpu-a:8000/v1 refused") == "http://***@gpu-a:8000/v1 refused"

A password can reach flashdraft inside a store URL, `AWS_ENDPOINT_URL` or a `--base-url`, and from there any
error message. The CLI's consoles, its JSON output, `status` (and STATUS.md), generate's errors files and the
debug logs of `sync --verbose` all pass through `redact`; the session keys of the AWS chain are scrubbed from
those logs as well (`store.SecretRedactor`).
"""

from __future__ import annotations

import os
import re

# scheme://userinfo@ — the userinfo has no '/', whitespace, quote or '@' (RFC 3986 §3.2.1)
USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"<>]+@")


# Environment variables whose values are secrets (read at each call: a test or a wrapper may set them late).
SECRET_VARIABLES = ("OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
                    "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
MIN_SECRET = 6  # shorter values ("none", "EMPTY", a test's "x") would blot out ordinary words


def redact(text: str) -> str:
    text = USERINFO.sub(r"\g<scheme>***@", text)
    for name in SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= MIN_SECRET and value in text:
            text = text.replace(value, "***")
    return text
