"""Which assistant turns generate regenerates, and from what history.

`final`: the last turn, from the dataset's history (earlier assistant turns keep the dataset's words).
`all`: every assistant turn in order, each from the history as regenerated so far — user and tool turns kept,
assistant turns replaced by what the target said — so the whole conversation is the target's. A batch of
conversations advances one assistant turn per round (one backend call per round, all conversations of the
batch together); a conversation whose request fails in any round fails as a whole, and nothing of a batch is
committed before its last round, so a killed run never leaves a half-regenerated conversation counted as done.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from flashdraft.generate.backends import Completion
from flashdraft.generate.prompts import Prompt


class Backend(Protocol):
    def complete(self, prompts: list[Prompt], seed: int = 0) -> list[Completion]: ...


def assistant_turn(done: Completion) -> dict[str, Any]:
    """A regenerated turn as it is sent back as history and stored: the answer, with its reasoning beside it
    (chat templates decide whether an earlier turn's reasoning is shown; the backends send content only)."""
    turn = {"role": "assistant", "content": done.content}
    if done.reasoning:
        turn["reasoning"] = done.reasoning
    if done.tool_calls:
        turn["tool_calls"] = done.tool_calls
    return turn


def as_request(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as sent: every field but the reasoning (see `assistant_turn`)."""
    return [{k: v for k, v in m.items() if k != "reasoning"} for m in history]


def regenerate(backend: Backend, prompts: list[Prompt], turns: str, seed: int
               ) -> list[tuple[list[dict[str, Any]], Completion]]:
    """For each prompt, (the history its final completion answered, that completion). With `all`, the history
    holds the regenerated earlier assistant turns; a failed completion ends its conversation there."""
    if turns == "final":
        return list(zip((p.messages for p in prompts), backend.complete(prompts, seed=seed), strict=True))
    results: dict[str, tuple[list[dict[str, Any]], Completion]] = {}
    state = {p.id: ([], 0) for p in prompts}  # (history regenerated so far, next index into p.messages)
    pending, round_ = list(prompts), 0
    while pending:
        asks = []
        for p in pending:
            history, i = state[p.id]
            j = next((k for k in range(i, len(p.messages)) if p.messages[k]["role"] == "assistant"), len(p.messages))
            asks.append((p, history + p.messages[i:j], j))
        completions = backend.complete([replace(p, messages=as_request(h)) for p, h, _ in asks],
                                       seed=seed + 100_003 * round_)  # each round its own, reproducible, seed
        pending = []
        for (p, history, j), done in zip(asks, completions, strict=True):
            if done.error is not None or j == len(p.messages):
                results[p.id] = (history, done)
            else:
                state[p.id] = (history + [assistant_turn(done)], j + 1)
                pending.append(p)
        round_ += 1
    return [results[p.id] for p in prompts]
