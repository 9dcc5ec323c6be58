import subprocess
import sys

import pytest


def run_cli(*args: str, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess, as a user or a script would run it."""
    proc = subprocess.run([sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"flashdraft {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli
