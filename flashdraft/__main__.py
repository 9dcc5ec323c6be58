from flashdraft.cli import app

if __name__ == "__main__":  # guarded: worker processes (spawn) import this module without running the CLI
    app(prog_name="flashdraft")
