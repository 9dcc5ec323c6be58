from flashdraft.guard import bind_to_launcher

bind_to_launcher()  # before the imports below (seconds): a torchrun killed meanwhile must not leave this process on

from flashdraft.cli import app  # noqa: E402 (after the launcher is bound, on purpose)

if __name__ == "__main__":  # guarded: worker processes (spawn) import this module without running the CLI
    app(prog_name="flashdraft")
