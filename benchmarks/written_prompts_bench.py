"""Questions the target writes, used as more training prompts: issue 20's data lever, measured past the demo's budget.

    .venv/bin/python benchmarks/levers_bench.py --work /tmp/levers --levers layers-4  # demo data, held-out answers
    .venv/bin/python benchmarks/written_prompts_bench.py --work /tmp/levers [--questions 4320] [--steps 3600]

The demo's drafter is bound by its 1,267 hand-written prompts (benchmarks/RESULTS.md, "draft depth"). Here the
embedded target writes more: one meta-prompt per subject × asker × style below (written for this script, 4,320
in all) asks it for one question a user might ask, sampled at temperature 0.5. The question is the quoted text of
its reply (or its first question sentence); replies without one, questions about asking or about an assistant,
duplicates, and any question that looks templated from or into a `builtin:chat-heldout` prompt (the held-out
sets' own check, `templated_like`) are dropped and counted. The target's greedy answers to the rest join the
demo's data (`flashdraft tokenize` with both inputs), a drafter with the demo's train settings (`--steps`
optimizer steps) trains on it, and is scored on the held-out answers the way levers_bench scores a lever. Each
stage's wall time is printed beside the result, so the row says what the data costs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
import time
from pathlib import Path

import yaml
from levers_bench import ROOT, flashdraft, heldout_dataset, score  # beside this script

SUBJECTS = {
    "math": ["fractions", "percentages", "compound interest", "the area of a circle", "prime numbers",
             "solving linear equations", "quadratic equations", "probability with dice", "averages and medians",
             "unit conversion", "ratios in recipes", "the Pythagorean theorem", "simple interest on a loan",
             "speed, distance and time", "negative numbers", "exponents", "square roots", "the volume of a box",
             "discounts while shopping", "splitting a bill", "angles in a triangle", "long division",
             "multiplying decimals", "estimating with rounding", "graphs of lines", "counting combinations",
             "the perimeter of a garden", "time zones arithmetic", "budgeting a monthly salary",
             "converting temperatures"],
    "code": ["reversing a string in Python", "reading a CSV file", "sorting a list of dictionaries",
             "writing a for loop", "handling exceptions", "JavaScript arrays", "SQL joins", "a binary search",
             "recursion", "Python classes", "regular expressions", "HTTP requests in Python", "git branches",
             "unit tests", "list comprehensions", "counting words in a file", "a stack data structure",
             "JSON parsing", "async functions in JavaScript", "bash scripts", "finding duplicates in a list",
             "string formatting", "a simple web server", "debugging a null pointer error", "HTML forms",
             "CSS flexbox", "merging two sorted lists", "dates and times in Python",
             "a function that checks palindromes", "environment variables"],
    "explain": ["photosynthesis", "how vaccines work", "black holes", "inflation", "the water cycle",
                "how the internet works", "climate change", "the immune system", "how airplanes fly",
                "why the sky is blue", "supply and demand", "earthquakes", "the French Revolution", "DNA",
                "electricity", "how batteries work", "the moon's phases", "volcanoes", "how computers store data",
                "the Roman Empire", "tides", "sleep", "the stock market", "gravity", "recycling",
                "how bees make honey", "the heart", "rainbows", "democracy", "machine learning"],
    "writing": ["a birthday message for a friend", "a cover letter", "a short poem about autumn",
                "a story about a lost dog", "an email asking for a day off",
                "a product description for a water bottle", "a thank-you note", "a speech for a wedding",
                "a haiku about the sea", "a review of a restaurant", "a blog post about travel", "an apology letter",
                "a limerick about a cat", "a slogan for a bakery", "a letter to a future self",
                "a short mystery story", "an invitation to a party", "a motivational message",
                "a summary of a meeting", "a tweet announcing a new app", "a dialogue between two robots",
                "a fairy tale opening", "a complaint to a landlord", "a recipe introduction",
                "a farewell message to a coworker", "a description of a sunset",
                "a social media post about a charity run", "a song chorus about summer",
                "a letter of recommendation", "a short bio for a website"],
}
ASKERS = ["a student", "a beginner", "a busy parent", "a curious child", "a small business owner", "a teacher"]
STYLES = ["Keep it short.", "Make it specific.", "Ask for an example.", "Ask for step-by-step help.",
          "Ask for a comparison.", "Include a small detail from their life."]
ABOUT_ASKING = re.compile(r"\b(ai|assistant|question|ask|asked|asking)\b", re.I)


def meta_prompts(count: int) -> list[dict]:
    rows = [{"prompt": f"Write one question that {asker} might ask an AI assistant about {subject}. {style} "
                       "Reply with the question only.", "category": kind}
            for kind, subjects in SUBJECTS.items()
            for subject, asker, style in itertools.product(subjects, ASKERS, STYLES)]
    random.Random(0).shuffle(rows)
    return rows[:count]


def question_in(reply: str) -> str | None:
    """The question a reply offers: its quoted text, else its first sentence ending in '?'."""
    for candidate in re.findall(r'"([^"\n]{12,300})"', reply) or re.findall(r"([A-Z][^.!?\n\"]{10,300}\?)", reply):
        candidate = candidate.strip()
        if candidate.endswith(("?", ".")) and not ABOUT_ASKING.search(candidate):
            return candidate
    return None


def screened_questions(replies_dir: Path) -> tuple[list[dict], dict[str, int]]:
    from flashdraft.generate.prompts import load_prompts, normalize, templated_like

    heldout = load_prompts("builtin:chat-heldout").prompts
    kept, seen, dropped = [], set(), {}
    for batch in sorted(replies_dir.glob("batch-*.jsonl")):
        for line in batch.read_text().splitlines():
            question = question_in(json.loads(line)["content"] or "")
            reason = None
            if question is None:
                reason = "no question in the reply"
            elif not 4 <= len(question.split()) <= 60:
                reason = "length"
            elif question.lower() in seen:
                reason = "duplicate"
            else:
                mine = [normalize({"prompt": question})]
                if templated_like(heldout, mine) or templated_like(mine, heldout):
                    reason = "looks like a held-out prompt"
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            seen.add(question.lower())
            kept.append({"prompt": question})
    return kept, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/levers"), help="levers_bench's work directory")
    ap.add_argument("--questions", type=int, default=4320, help="meta-prompts (at most 4,320)")
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=3600, help="optimizer steps of the drafter")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    base = yaml.safe_load((args.work / "demo.yaml").read_text())  # levers_bench wrote it: the demo's settings
    out = args.work / f"written-{args.questions}"
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        seconds[name] = round(time.perf_counter() - t0)

    (out / "meta.jsonl").write_text("".join(json.dumps(r) + "\n" for r in meta_prompts(args.questions)))
    timed("questions", lambda: flashdraft(
        "generate", "--prompts", str(out / "meta.jsonl"), "--out", str(out / "replies"), "--max-new-tokens", "40",
        "--temperature", str(args.temperature), "--dtype", "bfloat16", "--batch-size", "64"))
    kept, dropped = screened_questions(out / "replies")
    (out / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    gen = base["generate"]
    timed("answers", lambda: flashdraft(
        "generate", "--prompts", str(out / "questions.jsonl"), "--out", str(out / "answers"),
        "--max-new-tokens", str(gen["max_new_tokens"]), "--dtype", gen["dtype"], "--batch-size", "64"))
    demo_generated = Path(base["workdir"]) / "generate"
    timed("tokenize", lambda: flashdraft(
        "tokenize", "--input", str(demo_generated), "--input", str(out / "answers"), "--out", str(out / "dataset"),
        "--max-length", str(base["tokenize"]["max_length"]), "--block-size", str(base["tokenize"]["block_size"])))
    config = out / f"train-{args.steps}.yaml"
    config.write_text(yaml.safe_dump({**base, "train": {**base["train"], "max_steps": args.steps}}))
    trained = out / f"train-{args.steps}"  # the data above is shared by runs of other --steps; each trains its own
    timed("features + training", lambda: flashdraft(
        "train", "--config", str(config), "--data", str(out / "dataset"), "--out", str(trained)))
    row = {"written_questions": len(kept), "dropped": dropped, "steps": args.steps, "seconds": seconds,
           **score(trained / "drafter", heldout_dataset(args.work))}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
