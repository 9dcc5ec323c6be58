from flashdraft.cli import app

app(prog_name="flashdraft")
