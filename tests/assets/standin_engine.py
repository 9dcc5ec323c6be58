"""A stand-in for vLLM's OpenAI server, for what a real engine cannot be made to do: answer from a neighbour's
process, die mid-run, leave a child behind, send counters that do not add up. Started by eval as vLLM would be
(`eval.engine_python` names a wrapper that runs this file), it reads `--uds PATH` like vLLM and behaves as
$FLASHDRAFT_STANDIN_MODE says:

- honest:     serves /health (200, empty body, as vLLM), /metrics and /v1/completions; one draft a token, half kept
- neighbour:  a process in another session binds the socket and answers (with counters worth τ 4); this one
              "loads" forever
- dies:       serves /health, then exits 3 on the first completion, after a last line in its log
- child:      honest, plus a grandchild that sleeps; both pids go to $FLASHDRAFT_STANDIN_PIDS
- garbage:    /metrics carries a position label far past the block and a NaN counter
"""

import json
import os
import socketserver
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler

MODE = os.environ.get("FLASHDRAFT_STANDIN_MODE", "honest")
COUNTS = {"drafts": 0, "draft_tokens": 0, "accepted": 0}


class Handler(BaseHTTPRequestHandler):
    def address_string(self):
        return "unix"

    def answer(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self.answer(b"")
        if self.path == "/metrics":
            scale = 8 if MODE == "neighbour" else 1
            lines = [f"vllm:spec_decode_num_drafts_total{{engine=\"0\"}} {COUNTS['drafts']}",
                     f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {3 * COUNTS['drafts']}",
                     f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {min(3, scale) * COUNTS['drafts']}"]
            if MODE == "garbage":
                lines += ['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="999999999"} 1.0',
                          "vllm:spec_decode_num_drafts_total{engine=\"1\"} NaN"]
            return self.answer(("\n".join(lines) + "\n").encode(), "text/plain")
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if MODE == "dies":
            print("RuntimeError: the stand-in engine's worker died (CUDA error: an illegal memory access)", flush=True)
            os._exit(3)
        tokens = body.get("max_tokens", 8)
        COUNTS["drafts"] += tokens // 2
        return self.answer(json.dumps({"choices": [{"text": " hello" * tokens}],
                                       "usage": {"completion_tokens": tokens}}).encode())

    def log_message(self, *args):
        pass


class Server(socketserver.UnixStreamServer):
    pass


def serve(path: str) -> None:
    with Server(path, Handler) as server:
        server.serve_forever()


def main() -> None:
    path = sys.argv[sys.argv.index("--uds") + 1]
    if MODE == "neighbour":
        # another session, not the engine's group: what a neighbour that took the address would be
        subprocess.Popen([sys.executable, __file__, "--uds", path],
                         env=dict(os.environ, FLASHDRAFT_STANDIN_MODE="honest-8"), start_new_session=True)
        while True:
            time.sleep(1)
    if MODE == "child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        # written whole, then renamed: the test reads the file the moment it exists
        pids = os.environ["FLASHDRAFT_STANDIN_PIDS"]
        with open(pids + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        os.replace(pids + ".tmp", pids)
    serve(path)


if __name__ == "__main__":
    if MODE == "honest-8":  # the neighbour's own process: honest, with counters worth τ 4
        MODE = "neighbour"
        serve(sys.argv[sys.argv.index("--uds") + 1])
    else:
        main()
