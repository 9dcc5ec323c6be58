"""The `flashdraft` application: its console, one-line failures, `--help` with each option's default, `--json`."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from flashdraft import __version__
from flashdraft.errors import ExpectedFailure, Stopped
from flashdraft.redact import redact


class PlainConsole(Console):
    """flashdraft's output: plain text (no console markup, so a reason holding `[/…]`, such as a bucket name, is
    printed as it is) with URL credentials redacted from every line, on a terminal and in a log file alike."""

    def __init__(self, **kwargs) -> None:
        super().__init__(highlight=False, soft_wrap=True, markup=False, **kwargs)

    def print(self, *objects, **kwargs) -> None:
        super().print(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)


console = PlainConsole()
err_console = PlainConsole(stderr=True)


class JsonOutput:
    """Whether this command was asked for `--json`, and whether it has printed its JSON object yet: a failure
    prints `{"ok": false, "error": …}` on stdout too, so a script always reads one object."""

    requested = False
    emitted = False


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(Text.assemble(("error:", "red"), " ", redact(message)))
    if JsonOutput.requested and not JsonOutput.emitted:
        emit_json({"ok": False, "error": message})
    raise typer.Exit(code)


class App(typer.Typer):
    """Every command's expected failures become one `error:` line and exit 1; other exceptions stay bugs. Every
    stage option's help shows its effective default, read from the config schema (where the defaults live)."""

    def __call__(self, *args, **kwargs):
        """A usage error (an unknown option, `--max-steps abc`) is an expected failure like any other: one `error:`
        line naming the option, exit 1, and with `--json` one JSON object — not the option library's box and exit 2."""
        command = typer.main.get_command(self)
        show_config_defaults(command)
        try:
            code = command.main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            err_console.print("Aborted.")
            sys.exit(1)
        except typer.TyperException as e:  # the option library's errors (typer's own click)
            if getattr(e, "exit_code", 1) != 2:  # not a usage error: as the library shows it
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            where = f" (flashdraft {ctx.info_name} --help)" if ctx is not None and ctx.parent is not None else ""
            JsonOutput.requested = "--json" in sys.argv[1:]
            try:
                fail(f"{e.format_message()}{where}")
            except typer.Exit as exit_:
                sys.exit(exit_.exit_code)
        sys.exit(code if isinstance(code, int) else 0)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def decorator(fn):
            @functools.wraps(fn)
            def wrapped(*a, **kw):
                JsonOutput.requested, JsonOutput.emitted = bool(kw.get("json_out")), False
                try:
                    with stop_signals_unwind():
                        return fn(*a, **kw)
                except Stopped as e:
                    fail(f"stopped by {e.signal_name}; what it had started was stopped with it (rerun the same command "
                         "to go on)")
                except ExpectedFailure as e:
                    fail(str(e))
                except OSError as e:  # the machine said no (disk full, read-only, not a directory): not a bug
                    fail(f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e))

            register(wrapped)
            return fn

        return decorator


@contextmanager
def stop_signals_unwind():
    """SIGTERM (a scheduler's stop, `kill`) raises Stopped where the command is, as Ctrl-C raises KeyboardInterrupt:
    its `finally` blocks run and the engines it started are stopped (evaluate/engines.py). Without this, Python's
    default for SIGTERM ends the process on the spot and a child in its own session keeps running."""
    def raise_stopped(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    def redeliver(unraisable):
        # A signal that lands in a finalizer (a progress bar's __del__) raises there, and Python drops an exception
        # that leaves a finalizer after printing it: the stop would be lost. It is sent again, a moment later, to
        # land in the command's own code.
        if isinstance(unraisable.exc_value, Stopped):
            again = threading.Timer(0.05, os.kill, (os.getpid(), signal.Signals[unraisable.exc_value.signal_name]))
            again.daemon = True
            again.start()
            return
        previous_hook(unraisable)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous, previous_hook = signal.signal(signal.SIGTERM, raise_stopped), sys.unraisablehook
    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = previous_hook


# A stage command's options that set its config section under another name than the option's.
OPTION_KEYS = {"base_url": "base_urls"}


def show_config_defaults(command) -> None:
    """Append `(default: …)` to the help of each stage command's options, from the config schema's defaults (the
    options themselves default to None, meaning "from --config, else the schema")."""
    from flashdraft.config import PipelineConfig

    defaults = PipelineConfig()
    for name, sub in getattr(command, "commands", {}).items():
        section = getattr(defaults, name, None) if name in ("generate", "tokenize", "train", "eval") else None
        if section is None:
            continue
        for param in sub.params:
            key = OPTION_KEYS.get(param.name, param.name)
            if (name, key) == ("generate", "prompts"):
                param.help += " (required, or generate.prompts in --config)"
            elif key in type(section).model_fields and param.help and "(default:" not in param.help:
                param.help += f" (default: {shown_default(getattr(section, key))})"  # () not []: rich markup


def shown_default(value) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


app = App(
    name="flashdraft",
    help="Train DFlash speculative-decoding drafters end to end. Every stage's output is an artifact "
    "(data files + manifest.json, written last) that counts as done only when it verifies where it lives.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
JsonFlag = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout (human output goes to stderr).")
]
ConfigFlag = Annotated[
    Path | None, typer.Option("--config", help="Pipeline YAML; its section for this stage gives defaults.")
]


def human(json_out: bool) -> Console:
    """Where human-readable output goes: stdout, or stderr when stdout is reserved for --json."""
    return err_console if json_out else console


def emit_json(obj: dict[str, Any]) -> None:
    JsonOutput.emitted = True
    print(redact(json.dumps(obj, sort_keys=True)))


def _version(value: bool) -> None:
    if value:
        print(f"flashdraft {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Train DFlash drafters: generate → tokenize → train → eval, with verified artifacts and sync."""
    if not sys.stderr.isatty():  # a log file: library progress bars (weights loading, shards) would fill it
        quiet_library_progress_bars()


def quiet_library_progress_bars() -> None:
    """Hugging Face's bars (weights loading, downloads) and tqdm's own (GGUF conversion, datasets) off: \r-lines in
    a log file. Environment variables, which those libraries read when they are imported (after this, in a
    command) and which the processes a command starts inherit."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
