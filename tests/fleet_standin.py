"""A loopback stand-in for a fleet's vLLM server, for what a test must make a server do that a real one is not
made to: serve one model's states under a name that says another's layers, swap its model mid-run, answer without a
key. It answers as vLLM's extraction does (tests/train/test_engine_features.py runs the real one): `/v1/models`
lists the served name and the model it loaded (`root`); `/v1/completions` with token ids writes the states of
`layers` (decoder layer i's output, before the final norm) for them into the shared directory under the request's
id, with its lock, and answers the file's path and the greedy next token the model chose.

    with StandIn(storage, model_dir, [0, 2, 5], name, key) as server:  server.url; server.model_dir = other
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashdraft.train.engine_features import PROBE


class StandIn:
    def __init__(self, storage: Path, model_dir: str, layers: list[int], name: str, key: str | None) -> None:
        self.storage, self.layers, self.name, self.key = storage, layers, name, key
        self.models: dict[str, torch.nn.Module] = {}
        self.model_dir = model_dir  # what it serves: a test may change it while the server runs
        self.requests: list[list[int]] = []  # every sequence asked for, in order
        # (probes, model): after answering that many probes (flashdraft's fixed proof sequence), serve that model
        self.swap_after_probes: tuple[int, str] | None = None
        self.version = "0.32.0"  # what /version says
        self.lock = threading.Lock()  # one answer at a time: the hooks are the model's, shared by every thread
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.model_dir not in self.models:
            self.models[self.model_dir] = AutoModelForCausalLM.from_pretrained(self.model_dir,
                                                                               dtype=torch.float32).eval()
        return self.models[self.model_dir]

    @torch.no_grad()
    def states(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        model, captured = self.model(), {}
        hooks = [model.model.layers[i].register_forward_hook(
            lambda m, a, out, i=i: captured.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0]))
            for i in self.layers]
        try:
            logits = model(torch.tensor([ids])).logits
        finally:
            for hook in hooks:
                hook.remove()
        return torch.stack([captured[i] for i in self.layers], dim=1), int(logits[0, -1].argmax())

    def handler(self):
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def authorised(self) -> bool:
                if standin.key is None or self.headers.get("Authorization") == f"Bearer {standin.key}":
                    return True
                self.reply(401, {"error": "Unauthorized"})
                return False

            def do_GET(self):
                if self.path == "/version":  # open, as vLLM's is
                    return self.reply(200, {"version": standin.version})
                if self.authorised():
                    self.reply(200, {"data": [{"id": standin.name, "root": standin.model_dir}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.authorised():
                    return
                with standin.lock:
                    standin.requests.append(body["prompt"])
                    states, chosen = standin.states(body["prompt"])
                    probes = sum(1 for r in standin.requests if r == PROBE)
                    if standin.swap_after_probes and body["prompt"] == PROBE and probes == standin.swap_after_probes[0]:
                        standin.model_dir = standin.swap_after_probes[1]
                path = standin.storage / f"cmpl-{body['request_id']}-0-abcd1234.safetensors"
                save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(body["prompt"])},
                          str(path))
                path.with_name(path.name + ".lock").write_bytes(b"")
                self.reply(200, {"choices": [{"token_ids": [chosen]}],
                                 "kv_transfer_params": {"hidden_states_path": str(path)}})

        return Handler

    def __enter__(self) -> StandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
