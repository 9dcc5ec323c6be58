"""docs/config-keys.md, every config key with its default, what it accepts and what it does, generated from the config
model itself (flashdraft/config.py), so that the page cannot drift from the code:

    .venv/bin/python -m flashdraft.config_reference > docs/config-keys.md   # tests/test_config_reference.py checks

What a key does is the comment beside it in config.py (on its line, else the comment lines right above it): the
one place a key is explained. A key without one fails the test. What it accepts comes from its type and bounds.
Hand-rolled over a pydantic JSON schema: that schema drops the bounds inside `X | None` unions and the comments.
"""

from __future__ import annotations

import ast
import io
import json
import tokenize
import types
import typing
from pathlib import Path

from pydantic import BaseModel

import flashdraft.config as config

SECTIONS = {"generate": config.GenerateConfig, "tokenize": config.TokenizeConfig, "train": config.TrainConfig,
            "eval": config.EvalConfig}
BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "at least"))


def comments(source: str) -> dict[int, str]:
    """Each comment's text by its line number (1-based)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def notes(cls: type[BaseModel]) -> dict[str, str]:
    """Each field of `cls`: the comment on its line, else the comment lines right above it (joined)."""
    source = Path(config.__file__).read_text()
    said, lines = comments(source), source.splitlines()
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == cls.__name__)
    found = {}
    for node in body.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        trailing = [said[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in said
                    and not lines[n - 1].lstrip().startswith("#")]
        above, n = [], node.lineno - 1
        while n in said and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, said[n])
            n -= 1
        found[node.target.id] = " ".join(trailing or above)
    return found


def accepts(annotation) -> str:
    """What a key accepts, in words: choices, a type with its bounds, a list of them, or none."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        base, *metadata = args
        limits = [f"{sign} {getattr(m, name)}" for m in metadata for item in [m] for name, sign in BOUNDS
                  if getattr(item, name, None) is not None]
        limits += [f"{sign} {getattr(inner, name)}" for m in metadata for inner in getattr(m, "metadata", [])
                   for name, sign in BOUNDS if getattr(inner, name, None) is not None]
        return accepts(base) + (f" ({', '.join(limits)})" if limits else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(accepts(a) for a in args)
    if origin is list:
        return f"list of {accepts(args[0])}" if args else "list"
    if annotation is type(None):
        return "`null`"
    return getattr(annotation, "__name__", str(annotation))


def accepts_field(field) -> str:
    """A field's accepted values: pydantic keeps a top-level Annotated's bounds in the field's metadata."""
    if field.metadata:
        return accepts(typing.Annotated[(field.annotation, *field.metadata)])
    return accepts(field.annotation)


def default(value) -> str:
    return f"`{json.dumps(value)}`"


def reference() -> str:
    out = ["# Every config key", "",
           "Generated from `flashdraft/config.py` by "
           "`.venv/bin/python -m flashdraft.config_reference > docs/config-keys.md`"
           " (a test fails when this page and the code differ). A run's YAML sets any of them under its section "
           "(`train:`, `eval:` …); the options a command shows in `--help` override them. Defaults are the embedded "
           "demo's.", ""]
    top = config.PipelineConfig
    out += ["## top level", "", "| key | default | accepts | what |", "| --- | --- | --- | --- |"]
    said = notes(top)
    for name, field in top.model_fields.items():
        if name not in SECTIONS:
            out.append(f"| `{name}` | {default(field.default)} | {accepts_field(field)} | {said[name]} |")
    for section, cls in SECTIONS.items():
        said = notes(cls)
        out += ["", f"## {section}", "", "| key | default | accepts | what |", "| --- | --- | --- | --- |"]
        for name, field in cls.model_fields.items():
            what = said.get(name, "").replace("|", "\\|")
            out.append(f"| `{name}` | {default(field.default)} | {accepts_field(field)} | {what} |")
    return "\n".join(out) + "\n"


def undocumented() -> list[str]:
    """Keys with no comment in config.py: each must say what it does."""
    classes = {"": config.PipelineConfig, **SECTIONS}
    return [f"{section}.{name}".lstrip(".") for section, cls in classes.items() for name, text in notes(cls).items()
            if not text and name not in SECTIONS]


if __name__ == "__main__":
    print(reference(), end="")
