"""The `cli` fixture's forked commands (tests/forked_cli.py) are the commands a fresh interpreter runs: the same
output, exit code, environment and directory, and a fresh interpreter where a fork could differ."""

import json
import os
import subprocess
import sys


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
