"""Serving engines in the loop: the acceptance length τ a real engine gives the drafter, beside eval's own.

    flashdraft eval --drafter work/train/drafter --out work/eval --engine vllm          # flashdraft starts vLLM
    flashdraft eval --drafter … --out … --engine vllm --engine-url http://gpu-a:8000    # one already serving

Users judge a drafter by the τ their engine gives, and engines differ (block size, layout, layer numbering, a
reduced vocabulary, dtype), so eval can measure it there too: the engine serves the target with the drafter, the
same prompts go to it with the same token budget and temperature (rendered here with the target's chat template and
sent as token ids, so the engine sees exactly the prompt eval decoded; a later turn follows the engine's own answer),
and acceptance is read from the engine's own counters before and after:

- **vLLM** (`/metrics`, Prometheus): `spec_decode_num_drafts`, `…_draft_tokens`, `…_accepted_tokens` and
  `…_accepted_tokens_per_pos`; τ = 1 + accepted / drafts, vLLM's own mean acceptance length (bonus included).
- **llama.cpp** (each answer's `timings`): `draft_n` and `draft_n_accepted`.

How each engine is started (its command line, where it is installed, whether it can hold the target here) is
engine_commands.py. Every answer is untrusted input: parsed here against a schema, its counters checked finite,
non-negative, within the block and consistent before they enter a report. Its log goes to `engine-*.log` in the
output. Tokens/s are measured with and without the drafter (a second start without it) unless `eval.engine_baseline`
is off. On a 2-core CPU the numbers say whether the export is read as trained; speed there says little about a GPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, Field, ValidationError

from flashdraft.evaluate.engine_commands import drafts_per_step, engine_program, llamacpp_command, vllm_command
from flashdraft.layout import cache_dir
from flashdraft.served import SERVED_NAME, Endpoint, EngineFailed, ask, served, vllm_cpu_fixes_env

ENGINES = ("vllm", "llamacpp")


class Conversation(NamedTuple):
    """One prompt as an engine is asked it: its first turn's messages and later user turns, in a thinking mode
    (rendered by render(messages, thinking)), counted under its set and the set's category."""

    dataset: str
    messages: list[dict]
    follow_ups: tuple[str, ...]
    thinking: bool
    category: str = "all"
    id: str = ""  # eval's id for the prompt: report.json's engine rows name it, beside eval's own rows


Turns = list[Conversation]


# draft counts by (set, category): a set's τ is its categories' counts added, as eval adds its prompts'
Cells = dict[tuple[str, str], dict[str, float]]


ANSWER_DEADLINE_S = 600  # one completion on a 2-core CPU; on a GPU seconds


@dataclass(frozen=True)
class Counters:
    """vLLM's speculative-decoding counters at one moment (totals since the server started)."""

    drafts: float
    draft_tokens: float
    accepted: float
    by_position: tuple[float, ...]

    def plus(self, other: Counters) -> Counters:
        return Counters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                        self.accepted + other.accepted, ())

    def minus(self, earlier: Counters) -> Counters:
        width = max(len(self.by_position), len(earlier.by_position))
        now, then = (list(c.by_position) + [0.0] * (width - len(c.by_position)) for c in (self, earlier))
        return Counters(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                        self.accepted - earlier.accepted, tuple(a - b for a, b in zip(now, then, strict=True)))


class EngineAnswerInvalid(EngineFailed):
    """What the engine answered is not what the engine answers: wrong shape, out of range, inconsistent."""


def finite_count(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise EngineAnswerInvalid(f"/metrics: {what} is {text[:40]!r}, not a number") from None
    if not math.isfinite(value) or value < 0:
        raise EngineAnswerInvalid(f"/metrics: {what} is {value}, not a finite count")
    return value


def parse_metrics(text: str, positions: int) -> Counters:
    """The spec-decode counters from a Prometheus text page (summed over engines; absent counters are 0). A block
    drafts `positions` tokens: a position label outside them is refused, not grown into."""
    totals: dict[str, float] = {}
    by_position = [0.0] * positions
    seen = -1
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        name = name.removesuffix("_total")
        count = finite_count(value, name)
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            label = labels.split('position="', 1)[1].split('"', 1)[0] if 'position="' in labels else ""
            if not label.isdigit() or int(label) >= positions:
                raise EngineAnswerInvalid(f"/metrics: acceptance at position {label[:20]!r}, outside the "
                                          f"{positions} positions a block drafts")
            by_position[int(label)] += count
            seen = max(seen, int(label))
        else:
            totals[name] = totals.get(name, 0.0) + count
    return Counters(totals.get("vllm:spec_decode_num_drafts", 0.0), totals.get("vllm:spec_decode_num_draft_tokens",
                    0.0), totals.get("vllm:spec_decode_num_accepted_tokens", 0.0), tuple(by_position[:seen + 1]))


def checked(made: Counters, positions: int) -> Counters:
    """Counts of one prompt, before they enter a report: none negative (a counter that went back is a restarted
    engine, or another), accepted within drafted, drafted within what `positions` a block allows."""
    problems = []
    if min((made.drafts, made.draft_tokens, made.accepted, *made.by_position), default=0.0) < 0:
        problems.append("a counter went backwards (did the engine restart?)")
    if made.accepted > made.draft_tokens:
        problems.append(f"{made.accepted:.0f} accepted of {made.draft_tokens:.0f} drafted tokens")
    if made.draft_tokens > made.drafts * positions:
        problems.append(f"{made.draft_tokens:.0f} drafted tokens in {made.drafts:.0f} drafts of at most {positions}")
    if any(at > made.drafts for at in made.by_position):
        problems.append("more acceptances at a position than drafts")
    if problems:
        raise EngineAnswerInvalid(f"the engine's counters do not add up: {'; '.join(problems)}")
    return made


def read_counters(endpoint: Endpoint, positions: int) -> Counters:
    return parse_metrics(ask(endpoint, "/metrics", deadline_s=30).decode("utf-8", "replace"), positions)


# ---------------------------------------------------------------------------------------------- talking to it


# ---------------------------------------------------------------------------------------------- starting it


class VllmChoice(BaseModel):
    text: str


class VllmUsage(BaseModel):
    completion_tokens: int = Field(ge=0)


class VllmAnswer(BaseModel):
    """What eval reads of vLLM's /v1/completions answer."""

    choices: list[VllmChoice] = Field(min_length=1)
    usage: VllmUsage


class LlamaTimings(BaseModel):
    predicted_n: int = Field(ge=0)
    draft_n: int = Field(default=0, ge=0)
    draft_n_accepted: int = Field(default=0, ge=0)


class LlamaAnswer(BaseModel):
    """What eval reads of llama-server's /completion answer."""

    content: str
    timings: LlamaTimings


def parsed(model: type[BaseModel], data: bytes, where: str) -> Any:
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise EngineAnswerInvalid(f"{where}: not the engine's answer: {'.'.join(map(str, first['loc'])) or 'top'}: "
                                  f"{first['msg']}") from None


# The target's own distribution at the temperature, nothing cut from it, as eval samples: llama-server otherwise
# samples with top_k 40, top_p 0.95 and min_p 0.05 (common/common.h), and vLLM with the sampling defaults of the
# target's generation_config.json (Qwen3.6's top_k 20, top_p 0.95). A truncated distribution is more confident and
# accepts more drafts: at T 1 on the demo drafter llama.cpp's τ was 0.08 above eval's before these were sent.
PLAIN_SAMPLING = {
    "vllm": {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0},
    "llamacpp": {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "top_n_sigma": -1.0,
                 "xtc_probability": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "dry_multiplier": 0.0, "dynatemp_range": 0.0},
}


def complete(engine: str, endpoint: Endpoint, prompt_ids: list[int], max_new_tokens: int, positions: int,
             temperature: float = 0.0, seed: int | None = None) -> tuple[str, int, Counters | None]:
    """One completion of the prompt's token ids — greedy, or sampled at `temperature` with the request's `seed` —:
    (its text, its completion token count, and — llama.cpp — the draft counts its answer carries: `timings.draft_n`,
    `draft_n_accepted`)."""
    sampled = {"seed": seed} if temperature > 0 and seed is not None else {}
    if engine == "vllm":
        path, body = "/v1/completions", {"model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": max_new_tokens,
                                         "temperature": temperature, **PLAIN_SAMPLING[engine], **sampled}
    else:
        path, body = "/completion", {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature,
                                     "cache_prompt": False, **PLAIN_SAMPLING[engine], **sampled}
    data = ask(endpoint, path, body, deadline_s=ANSWER_DEADLINE_S)
    if engine == "vllm":
        answer = parsed(VllmAnswer, data, f"{endpoint}{path}")
        tokens = answer.usage.completion_tokens
        text, counted = answer.choices[0].text, None
    else:
        answer = parsed(LlamaAnswer, data, f"{endpoint}{path}")
        tokens, accepted, drafted = (answer.timings.predicted_n, answer.timings.draft_n_accepted,
                                     answer.timings.draft_n)
        # each verify pass emits its accepted drafts and one token of the target's own; the first token comes from
        # the prompt's pass: so many drafts were verified (vLLM counts the same way)
        drafts = max(0, tokens - 1 - accepted) if drafted else 0
        text, counted = answer.content, checked(Counters(drafts, drafted, accepted, ()), positions)
    if tokens > max_new_tokens:
        raise EngineAnswerInvalid(f"{endpoint}{path}: {tokens} tokens where {max_new_tokens} were asked for")
    return text, tokens, counted


def decode_all(engine: str, endpoint: Endpoint, turns: Turns, render: Callable, max_new_tokens: int, positions: int,
               temperature: float = 0.0, seed: int | None = None,
               answers: list[dict] | None = None) -> tuple[Cells, float, int]:
    """Every prompt's turns, one at a time (greedy, or sampled with `seed`): {(set, category): the draft counts
    they made}, seconds, tokens. vLLM's counters are read before and after each prompt, so a prompt's counts are
    its own: that is what lets them be added up by category as well as by set. With `answers`, a row a prompt is
    appended to it — its id, set, category, seed, drafts, accepted drafts and the engine's answers — so that a
    category where the engine and eval differ can be followed down to the prompt."""
    by_cell: Cells = {}
    seconds, tokens = 0.0, 0
    for conversation in turns:
        messages = list(conversation.messages)
        before = read_counters(endpoint, positions) if engine == "vllm" else None
        made = Counters(0.0, 0.0, 0.0, ())
        row = by_cell.setdefault((conversation.dataset, conversation.category),
                                 {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "seconds": 0.0, "tokens": 0.0})
        said = []
        for turn in range(1 + len(conversation.follow_ups)):
            if turn:
                messages.append({"role": "user", "content": conversation.follow_ups[turn - 1]})
            started = time.perf_counter()
            text, n, counted = complete(engine, endpoint, render(messages, conversation.thinking), max_new_tokens,
                                        positions, temperature, seed)
            took = time.perf_counter() - started
            seconds, tokens = seconds + took, tokens + n
            row["seconds"], row["tokens"] = row["seconds"] + took, row["tokens"] + n
            if counted is not None:
                made = made.plus(counted)
            messages.append({"role": "assistant", "content": text})
            said.append(text)
        if before is not None:
            made = checked(read_counters(endpoint, positions).minus(before), positions)
        row["drafts"] += made.drafts
        row["draft_tokens"] += made.draft_tokens
        row["accepted"] += made.accepted
        for i, value in enumerate(made.by_position):
            row[f"position_{i}"] = row.get(f"position_{i}", 0.0) + value
        if answers is not None:
            answers.append({"id": conversation.id, "dataset": conversation.dataset, "category": conversation.category,
                            "seed": seed, "drafts": int(made.drafts), "accepted": int(made.accepted),
                            "acceptance_length": engine_tau(made.accepted, made.drafts),
                            "answers": said})
    return by_cell, seconds, tokens


def engine_tau(accepted: float, drafts: float) -> float | None:
    """τ as the engines define it: 1 + accepted drafts / verify passes (bonus token included); None with no pass."""
    return round(1 + accepted / drafts, 4) if drafts else None


def added(rows) -> dict[str, float]:
    """Counts (and seconds, tokens) summed over rows."""
    total: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            total[key] = total.get(key, 0.0) + value
    return total


def over_seeds(engine: str, endpoint: Endpoint, turns: Turns, render: Callable, max_new_tokens: int, positions: int,
               temperature: float, seeds: tuple[int | None, ...]) -> tuple[Cells, float, int, dict[str, Any]]:
    """decode_all once a seed: the draft counts pooled over the seeds, seconds, tokens, and what goes into the
    report beside them: each prompt's row (`prompts`) and, over several seeds, each seed's overall τ with their
    mean and standard deviation (`tau_over_seeds`)."""
    from flashdraft.evaluate.spread import over_seeds_spread

    pooled: Cells = {}
    seconds, tokens, taus, answers = 0.0, 0, {}, []
    for seed in seeds:
        by_cell, s, n = decode_all(engine, endpoint, turns, render, max_new_tokens, positions, temperature, seed,
                                   answers)
        seconds, tokens = seconds + s, tokens + n
        taus[seed] = summary(by_cell)["overall"]["acceptance_length"]
        for cell, row in by_cell.items():
            pooled[cell] = added([pooled.get(cell, {}), row])
    spread = over_seeds_spread(taus) if len(seeds) > 1 else None
    return pooled, seconds, tokens, {"prompts": answers, **({"tau_over_seeds": spread} if spread else {})}


def summary(by_cell: Cells) -> dict[str, Any]:
    """τ (1 + accepted / drafts, the engine's own definition) and acceptance by position: overall, per set, and per
    category within a set that has several (SPEED-Bench's 11, MT-Bench's 8) — as eval's own report groups them."""
    def one(row: dict[str, float]) -> dict[str, Any]:
        positions = sorted(int(k.split("_")[1]) for k in row if k.startswith("position_"))
        drafts = row["drafts"]
        return {"acceptance_length": engine_tau(row["accepted"], drafts),
                "drafts": int(drafts), "draft_tokens": int(row["draft_tokens"]),
                "accepted_tokens": int(row["accepted"]),
                "acceptance_by_position": [round(row[f"position_{i}"] / drafts, 4) if drafts else None
                                           for i in positions],
                "tokens_per_s": round(row["tokens"] / row["seconds"], 2) if row.get("seconds") else None}

    sets: dict[str, dict[str, dict[str, float]]] = {}
    for (dataset, category), row in by_cell.items():
        sets.setdefault(dataset, {})[category] = row
    by_dataset = {}
    for dataset, categories in sets.items():
        by_dataset[dataset] = one(added(categories.values()))
        if len(categories) > 1:
            by_dataset[dataset]["by_category"] = {c: one(row) for c, row in sorted(categories.items())}
    return {"overall": one(added(by_cell.values())) if by_cell else None, "by_dataset": by_dataset}


def speedups(result: dict[str, Any], plain: Cells) -> None:
    """Speedup beside τ, per set and per category (the two diverge: ModelOpt #2342): tokens/s with the drafter
    (in `result`) over tokens/s of the same prompts without it (`plain`)."""
    def beside(block: dict[str, Any], row: dict[str, float]) -> None:
        without = row["tokens"] / row["seconds"] if row["seconds"] else None
        block["tokens_per_s_without_drafter"] = round(without, 2) if without else None
        with_s = block["tokens_per_s"]
        block["speedup"] = round(with_s / without, 3) if without and with_s else None

    for dataset, block in result["by_dataset"].items():
        beside(block, added(row for (name, _), row in plain.items() if name == dataset))
        for category, inner in block.get("by_category", {}).items():
            beside(inner, plain[(dataset, category)])


def measure(engine: str, turns: Turns, render: Callable, *, target_dir: Path, drafter_dir: Path, block_size: int,
            max_new_tokens: int, longest_prompt: int, logs: Path, shown_log: Path, url: str | None = None,
            python: str | None = None, baseline: bool = True, dspark: bool = False, temperature: float = 0.0,
            seeds: tuple[int | None, ...] = (None,), draft_sampling: str = "greedy",
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """The engine's τ, acceptance by position (vLLM counts it) and tokens/s on `turns`: on the server at `url`, or
    on one started here with the drafter (and, with `baseline`, once more without it, for tokens/s without
    speculation). llama.cpp serves GGUF files: the drafter and the target are converted first (export_gguf, in
    float32 as eval decodes on a CPU; kept in the cache, a rerun reuses them)."""
    assert engine in ENGINES
    positions = drafts_per_step(block_size, dspark)
    if url is not None:
        by_set, seconds, tokens, extra = over_seeds(engine, Endpoint(url=url.rstrip("/")), turns, render,
                                                      max_new_tokens, positions, temperature, seeds)
        return {"engine": engine, "url": url, **summary(by_set), "tokens_per_s": round(tokens / seconds, 2),
                **extra}
    program = engine_program(engine, python)  # checked by the caller before eval's own work (check_engine)
    context = longest_prompt + 2 * (max_new_tokens + 512) + 2 * block_size  # two turns and their answers

    def command(with_drafter: bool) -> Callable[[Path], list[str]]:
        if engine == "vllm":
            return lambda where: vllm_command(program, target_dir, drafter_dir if with_drafter else None, block_size,
                                              where, context, dspark, draft_sampling)
        return lambda where: llamacpp_command(program, gguf / gguf_stats["target_file"],
                                              gguf / gguf_stats["drafter_file"] if with_drafter else None,
                                              block_size, where, context, dspark)

    if engine == "llamacpp":
        from flashdraft.artifact.manifest import identity, sha256_json
        from flashdraft.model.gguf_export import export_gguf

        # by content: a drafter changed in place is converted again, not served from an old file
        gguf = cache_dir() / "gguf" / sha256_json([identity(drafter_dir), identity(target_dir)])[:24]
        gguf_stats = export_gguf(drafter_dir, str(target_dir), gguf, outtype="f32", log=log)
    result: dict[str, Any] = {"engine": engine}
    name = f"engine-{engine}.log"
    # vLLM's CPU build samples at T > 0 only with flashdraft's fix for vllm#55005 (flashdraft/vllm_cpu)
    env = vllm_cpu_fixes_env() if engine == "vllm" else None
    with served(command(True), logs / name, log, shown_log / name, env=env) as endpoint:
        by_set, seconds, tokens, extra = over_seeds(engine, endpoint, turns, render, max_new_tokens, positions,
                                                      temperature, seeds)
    result |= summary(by_set) | {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens} | extra
    if baseline:  # tokens/s without the drafter: one pass over the prompts (the first seed's) is enough
        name = f"engine-{engine}-target-only.log"
        with served(command(False), logs / name, log, shown_log / name, env=env) as endpoint:
            plain, seconds, plain_tokens = decode_all(engine, endpoint, turns, render, max_new_tokens, positions,
                                                      temperature, seeds[0])
        speedups(result, plain)
        result["tokens_per_s_without_drafter"] = round(plain_tokens / seconds, 2)
        result["speedup"] = round(result["tokens_per_s"] / result["tokens_per_s_without_drafter"], 3)
        if result["overall"]:
            result["overall"]["speedup"] = result["speedup"]
    return result
