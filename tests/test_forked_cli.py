"""The `cli` fixture's forked commands (tests/forked_cli.py) are the commands a fresh interpreter runs: the same
output, exit code, environment and directory, and a fresh interpreter where a fork could differ."""

import json
import os
import subprocess
import sys
from pathlib import Path


def fresh(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, **kwargs)


def test_a_forked_command_says_and_exits_what_a_fresh_interpreter_does(cli, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("{not json")
    for args in (["verify", str(tmp_path / "a")], ["--help"], ["estimate", "--help"], ["status", "--json"]):
        forked, alone = cli(*args, cwd=tmp_path), fresh(*args, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    assert cli("verify", str(tmp_path / "a")).returncode == 1


def test_its_directory_is_the_tests_and_an_import_time_setting_gets_a_fresh_interpreter(cli, tmp_path):
    """A relative --config is read from the call's working directory, not the server's; a setting a library reads
    when it is imported (COLUMNS: rich's console width) is honoured by starting a fresh interpreter."""
    (tmp_path / "flashdraft.yaml").write_text("workdir: here\n")
    report = json.loads(cli("status", "--config", "flashdraft.yaml", "--json", cwd=tmp_path, check=True).stdout)
    assert report["stages"] and all("here" in row["artifact"] for row in report["stages"]), report
    shown = cli("status", "--config", "flashdraft.yaml", "--json", cwd=tmp_path,
                env=dict(os.environ, COLUMNS="40"))  # read at import by rich: a fresh interpreter runs it
    assert shown.returncode == 0


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    """A pytest worker killed outright (SIGKILL: no atexit) leaves no fork server behind."""
    import signal
    import time

    from tests.servers import alive

    script = ("import os, sys; sys.path.insert(0, os.getcwd()); from tests import forked_cli; "
              "forked_cli.run_cli('--help', check=True); print(forked_cli._server.process.pid, flush=True); "
              "import time; time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parents[1])
    server = int(starter.stdout.readline())
    assert alive(server)
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    deadline = time.time() + 30
    while alive(server):
        assert time.time() < deadline, f"the fork server {server} outlived the process that started it"
        time.sleep(0.1)


def test_commands_run_together_first_leave_the_server_for_the_next(tmp_path):
    """`run_cli_together` as a process's first command: the server it starts outlives the call's threads (started in
    one of them, it would die with it, as the parent death signal follows a thread), so the next command still forks,
    and each of the commands run together ran concurrently in a process of its own."""
    script = tmp_path / "first.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from tests import forked_cli\n"
        "together = forked_cli.run_cli_together(['--help'], ['--help'])\n"
        "server = forked_cli._server.process.pid\n"
        "after = forked_cli.run_cli('--help')\n"
        "print(json.dumps({'codes': [r.returncode for r in together] + [after.returncode],\n"
        "                  'alive': forked_cli._server.process.poll() is None,\n"
        "                  'same': forked_cli._server.process.pid == server}))\n")
    env = {k: v for k, v in os.environ.items() if k != "FLASHDRAFT_TEST_FORK"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"codes": [0, 0, 0], "alive": True, "same": True}
