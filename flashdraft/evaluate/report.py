"""The eval report: τ, acceptance by position, τ histogram, speedups, per category; and its two PNG plots."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from flashdraft.artifact.atomic import atomic_open
from flashdraft.config import EvalConfig
from flashdraft.evaluate.spread import eval_draws, tau_error
from flashdraft.model.objective import acceptance_length, expected_acceptance_length


def summarize(per_prompt: list[dict], block_size: int, cfg: EvalConfig) -> dict[str, Any]:
    sampled = cfg.temperature > 0

    def block(rows: list[dict]) -> dict[str, Any]:
        steps = [n for r in rows for n in r["accepted"]]
        error = tau_error(eval_draws(rows)) if sampled else None
        reach = [sum(n >= k for n in steps) for k in range(block_size)]  # reach[k]: steps with ≥ k accepted
        by_position = [reach[k] / len(steps) if steps else 0.0 for k in range(1, block_size)]
        conditional = [reach[k] / reach[k - 1] if reach[k - 1] else float("nan") for k in range(1, block_size)]
        spec_s, base_s = sum(r["spec_seconds"] for r in rows), sum(r["target_seconds"] for r in rows)
        lookup = all(r["lookup_seconds"] is not None for r in rows)  # not measured on stateful targets
        pld_s = sum(r["lookup_seconds"] for r in rows) if lookup else None
        pld_tokens = sum(r["lookup_tokens"] - 1 for r in rows)
        pld_forwards = sum(r["lookup_forwards"] - 1 for r in rows) if lookup else None
        lossless = [r["lossless"] for r in rows if r["lossless"] is not None]
        lookup_lossless = [r["lookup_lossless"] for r in rows if r["lookup_lossless"] is not None]
        return {
            "prompts": len(rows),  # decoded turns: mt-bench's prompts count twice
            # the input a turn was decoded after (its prompt and, for a later turn, the turns before): τ falls
            # with it, which SPEED-Bench's throughput sets measure
            "prompt_tokens_mean": round(statistics.fmean([r["prompt_tokens"] for r in rows]), 1),
            "acceptance_length": acceptance_length(steps),
            # temperature > 0: τ's standard error over prompts × seeds (evaluate/spread.py; None: one draw)
            **({"standard_error": error["standard_error"] if error else None} if sampled else {}),
            # z-lab's benchmark averages each turn's own τ (a short answer weighs as much as a long one)
            "acceptance_length_mean_per_turn": statistics.fmean(
                [acceptance_length(r["accepted"]) for r in rows if r["accepted"]] or [0.0]),
            "acceptance_length_from_rates": expected_acceptance_length(conditional),
            "acceptance_by_position": [round(x, 4) for x in by_position],
            "tau_histogram": dict(sorted(Counter(n + 1 for n in steps).items())),
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(spec_s, 1e-9),
            "target_tokens_per_s": sum(r["target_tokens"] for r in rows) / max(base_s, 1e-9),
            "speedup": base_s / max(spec_s, 1e-9),
            # Each prompt's three decodings run back to back, so machine noise hits them alike; the median and
            # spread of per-prompt ratios say how far the aggregate can be trusted on a shared machine.
            "speedup_per_prompt": spread([r["target_seconds"] / max(r["spec_seconds"], 1e-9) for r in rows]),
            "lookup_speedup_per_prompt": spread([r["target_seconds"] / max(r["lookup_seconds"], 1e-9)
                                                 for r in rows]) if lookup else None,
            "lookup_acceptance_length": pld_tokens / max(1, pld_forwards) if lookup else None,
            "lookup_speedup": base_s / max(pld_s, 1e-9) if lookup else None,
            "lossless": all(lossless) if lossless else None,
            "lookup_lossless": all(lookup_lossless) if lookup_lossless else None,
            # prompts counted lossless because they first differ from target-only output at a near-tie
            "near_ties": sum(1 for r in rows if r.get("divergence") and r["divergence"]["near_tie"]),
        }

    report = block(per_prompt)
    datasets, categories = defaultdict(list), defaultdict(list)
    for row in per_prompt:
        datasets[row.get("dataset", "prompts")].append(row)
        categories[row["category"]].append(row)
    report["by_dataset"] = {name: block(rows) for name, rows in datasets.items()}  # in the order given
    for name, rows in datasets.items():  # a set's own categories (SPEED-Bench's 11, MT-Bench's 8): a row each
        own = defaultdict(list)
        for row in rows:
            own[row["category"]].append(row)
        if len(own) > 1:
            report["by_dataset"][name]["by_category"] = {c: block(r) for c, r in sorted(own.items())}
    if len(categories) > 1:
        report["by_category"] = {name: block(rows) for name, rows in sorted(categories.items())}
    report["config"] = cfg.model_dump()
    return report


def dspark_summary(per_prompt: list[dict], block_size: int, cfg: EvalConfig) -> dict[str, Any]:
    """DSpark's own figures: the mean number of drafts sent for verification a step, and — with a confidence head —
    its calibration by slot (the mean σ(c_k) it gave a slot that verification reached, beside how often that
    slot's draft was then accepted). With `eval.confidence_threshold`, the same for the blocks uncut, beside τ."""
    def figures(accepted_key: str, proposed_key: str, confidence_key: str) -> dict[str, Any]:
        accepted = [n for r in per_prompt for n in r[accepted_key]]
        proposed = [m for r in per_prompt for m in r[proposed_key]]
        # a step's confidences are there only with a head: without, zip stops at once
        values_by_step = [values for r in per_prompt for values in r[confidence_key]]
        predicted, reached, taken = [0.0] * block_size, [0] * block_size, [0] * block_size
        for n, m, values in zip(accepted, proposed, values_by_step, strict=False):
            for slot in range(min(m, n + 1)):  # every draft before this slot was accepted: verification judged it
                reached[slot] += 1
                predicted[slot] += values[slot]
                taken[slot] += n > slot
        return {
            "acceptance_length": round(acceptance_length(accepted), 4),
            "mean_proposed": round(sum(proposed) / len(proposed), 4) if proposed else None,
            "calibration_by_slot": [{"slot": k, "reached": reached[k],
                                     "confidence": round(predicted[k] / reached[k], 4) if reached[k] else None,
                                     "accepted": round(taken[k] / reached[k], 4) if reached[k] else None}
                                    for k in range(block_size)] if values_by_step else None,
        }

    out = {"threshold": cfg.confidence_threshold, "rule": cfg.confidence_rule if cfg.confidence_threshold else None,
           **figures("accepted", "proposed", "confidence")}
    if cfg.confidence_threshold is not None:
        out["uncut"] = figures("accepted_uncut", "proposed_uncut", "confidence_uncut")
    return out


def markdown_report(report: dict[str, Any]) -> str:
    """The per-dataset τ table (report.md, and what eval prints), with what it was measured under."""
    cfg = report["config"]
    if report.get("engine_only"):  # the engines' tables alone: eval decoded nothing itself
        lines = [f"engine only — thinking {thinking_words(cfg['thinking'])}, {sampling_words(cfg)}, up to "
                 f"{cfg['max_new_tokens']} new tokens a turn, {report['prompts']} prompts; eval's own decoding was "
                 "not run"]
        for engine in report.get("engines", {}).values():
            lines += ["", *engine_table(engine, report)]
        return "\n".join(lines) + "\n"
    lossless = {True: "yes", False: "**no**", None: "not checked (sampled)"}
    lines = [
        f"τ by dataset — thinking {thinking_words(cfg['thinking'])}, {sampling_words(cfg)}, "
        f"up to {cfg['max_new_tokens']} new tokens a turn, {report['target_dtype']} target, "
        f"decoding: {report['decoding']}",
        *([SE_NOTE] if cfg["temperature"] > 0 else []),
        "",
        "| dataset | turns | input tokens | τ | τ, mean per turn | acceptance by position 1…K−1 | speedup, in-process "
        "| lossless |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    rows = list(report["by_dataset"].items())
    if len(rows) > 1:
        rows.append(("**all**", report))
    for name, block in rows:
        lines.append(table_row(name, block, lossless))
    for name, block in report["by_dataset"].items():
        if "by_category" in block:
            lines += ["", f"τ by category — {name}", "",
                      "| category | turns | input tokens | τ | τ, mean per turn | acceptance by position 1…K−1 | "
                      "speedup, in-process | lossless |", "|---|---:|---:|---:|---:|---|---:|---|"]
            lines += [table_row(category, rows, lossless) for category, rows in block["by_category"].items()]
    if "dspark" in report:
        lines += ["", *dspark_table(report["dspark"])]
    for engine in report.get("engines", {}).values():
        lines += ["", *(engine_table(engine, report) if not engine.get("failed") else
                        [f"τ in {engine['engine']}: not measured — it failed: {engine['failed']}"])]
    return "\n".join(lines) + "\n"


SE_NOTE = ("τ ± its standard error over prompts × seeds (a prompt's conversation under one seed is one draw); "
           "turns count each seed's")


def sampling_words(cfg: dict[str, Any]) -> str:
    """`greedy`, or the temperature with the draft rule and the seeds (a turn is counted once a seed)."""
    if not cfg["temperature"]:
        return "temperature 0 (greedy)"
    seeds = [cfg["seed"] + i for i in range(cfg.get("seeds", 1))]
    rule = cfg.get("draft_sampling", "greedy")
    return (f"temperature {cfg['temperature']:g}, draft rule {rule} ({RULE_WORDS[rule]}), "
            + (f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"))


RULE_WORDS = {"greedy": "argmax drafts, accepted with the target's probability of each",
              "sample": "drafts drawn from the drafter, accepted with min(1, p/q)"}


def judgement_lines(engine: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """At temperature > 0: the engine's τ against eval's, judged by their standard errors over prompts × seeds; and,
    over several seeds, each seed's τ (their standard deviation alone is too noisy to judge by)."""
    lines = []
    if comparable := engine.get("not_comparable"):
        lines.append(f"not judged against eval's τ: {comparable}")
    if verdict := engine.get("judged"):
        lines.append(f"difference from eval's τ {verdict['difference']:+.3f}: "
                     + ("within" if verdict["agrees"] else "**beyond**")
                     + f" {verdict['bound']:.3f} (2 combined standard errors, "
                     f"{verdict['combined_standard_error']:.3f}, or 0.04, whichever is larger); this run would have "
                     f"found a difference of {verdict['detectable']:.3f} 4 times in 5")
    theirs, ours = engine.get("tau_over_seeds"), report.get("tau_over_seeds")
    if theirs:
        line = f"each seed's τ: engine {seeds_words(theirs)}"
        if ours:
            line += f"; eval {seeds_words(ours)}"
        lines.append(line)
    return lines


def seeds_words(spread: dict[str, Any]) -> str:
    return " / ".join(f"{tau:.3f}" for tau in spread["by_seed"].values()) + f" (sd {spread['std']:.3f})"


def tau_cell(block: dict[str, Any], digits: int = 2) -> str:
    """τ, with its standard error where it was sampled (a sampled τ is never shown bare: one draw says so); the
    tables' cells, and (3 digits) eval's log lines."""
    tau = block.get("acceptance_length")
    if tau is None:
        return "—"
    if "standard_error" not in block:
        return f"{tau:.{digits}f}"
    se = block["standard_error"]
    return f"{tau:.{digits}f} ± {se:.{digits}f}" if se is not None else f"{tau:.{digits}f} ± ? (one draw)"


def thinking_words(setting) -> str:
    """`on`, `off`, or `on and off` (a row per set and mode)."""
    modes = [setting] if isinstance(setting, bool) else list(dict.fromkeys(setting))
    return " and ".join("on" if mode else "off" for mode in modes) + (" (a row each)" if len(modes) > 1 else "")


def table_row(name: str, block: dict[str, Any], lossless: dict) -> str:
    positions = " ".join(f"{x:.2f}" for x in block["acceptance_by_position"])
    return (f"| {name} | {block['prompts']} | {block['prompt_tokens_mean']:,.0f} | {tau_cell(block)} | "
            f"{block['acceptance_length_mean_per_turn']:.2f} | {positions} | {block['speedup']:.2f}× | "
            f"{lossless[block['lossless']]} |")


def dspark_table(dspark: dict[str, Any]) -> list[str]:
    """DSpark: drafts sent a step and τ, with the confidence cut and without; the head's calibration by slot."""
    runs = [("uncut" if dspark["threshold"] is None else f"cut at {dspark['rule']} < {dspark['threshold']:g}",
             dspark)]
    if "uncut" in dspark:
        runs.append(("uncut", dspark["uncut"]))
    lines = ["DSpark blocks — drafts sent for verification a step, and τ", "", "| blocks | mean drafts sent | τ |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {run['mean_proposed']:.2f} | {run['acceptance_length']:.2f} |" for name, run in runs]
    calibration = (dspark.get("uncut") or dspark)["calibration_by_slot"]
    if calibration:
        lines += ["", "confidence head calibration (uncut blocks): mean confidence a slot was given, when verification "
                  "reached it, beside how often it was accepted", "", "| slot | reached | confidence | accepted |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {row['slot']} | {row['reached']} | {_maybe(row['confidence'])} | {_maybe(row['accepted'])} |"
                  for row in calibration]
    return lines


def _maybe(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def engine_table(engine: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """An engine's τ beside eval's, per dataset, and its tokens/s with and without the drafter."""
    with_s, without_s = engine.get("tokens_per_s"), engine.get("tokens_per_s_without_drafter")
    pace = f"{with_s:g} tokens/s with the drafter" + (f", {without_s:g} without" if without_s else "")
    how = sampling_words(report["config"]) if "config" in report else "temperature 0 (greedy)"
    if engine.get("draft_rule"):
        how += f"; in {engine['engine']}: {engine['draft_rule']}"
    lines = [f"τ in {engine['engine']} (its own counters: 1 + accepted / drafts), {how}, the same prompts — {pace}"]
    lines += judgement_lines(engine, report)
    header = ["| {} | engine τ | eval τ | engine acceptance by position 1…K−1 | drafts | engine speedup |",
              "|---|---:|---:|---|---:|---:|"]
    rows = [(name, block, report["by_dataset"][name]) for name, block in engine["by_dataset"].items()]
    if len(rows) > 1:
        rows.append(("**all**", engine["overall"], report))
    lines += ["", header[0].format("dataset"), header[1], *(engine_row(*row) for row in rows)]
    for name, block in engine["by_dataset"].items():  # a set's categories, as eval's own table gives them
        if "by_category" in block:
            ours = report["by_dataset"][name].get("by_category", {})
            lines += ["", f"τ in {engine['engine']} by category — {name}", "", header[0].format("category"), header[1]]
            lines += [engine_row(category, inner, ours.get(category) or {})
                      for category, inner in block["by_category"].items()]
    return lines


def engine_row(name: str, block: dict[str, Any], ours: dict[str, Any]) -> str:
    tau = tau_cell(block)
    ours_cell = tau_cell(ours)  # engine only: eval measured nothing to set beside it (a dash)
    # llama.cpp counts no acceptance by position: a dash, not an empty cell
    positions = " ".join(f"{x:.2f}" for x in block["acceptance_by_position"] if x is not None) or "—"
    speedup = f"{block['speedup']:.2f}×" if block.get("speedup") else "—"  # without a baseline run: none
    return f"| {name} | {tau} | {ours_cell} | {positions} | {block['drafts']} | {speedup} |"


def spread(ratios: list[float]) -> dict[str, float] | None:
    """Median and the 10th–90th percentile range of per-prompt ratios."""
    if not ratios:
        return None
    if len(ratios) == 1:
        return {"median": round(ratios[0], 3), "p10": round(ratios[0], 3), "p90": round(ratios[0], 3)}
    deciles = statistics.quantiles(ratios, n=10, method="inclusive")
    return {"median": round(statistics.median(ratios), 3), "p10": round(deciles[0], 3), "p90": round(deciles[-1], 3)}


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    rates = report["acceptance_by_position"]
    ax.bar(range(1, len(rates) + 1), rates, color="#3b7dd8")
    ax.set(xlabel="block position k", ylabel="P(≥ k drafts accepted)", ylim=(0, 1),
           title=f"acceptance by position — τ = {report['acceptance_length']:.2f}")
    fig.tight_layout()
    with atomic_open(out / "acceptance_by_position.png") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    hist = report["tau_histogram"]
    ax.bar([int(k) for k in hist], list(hist.values()), color="#2a9d8f")
    ax.set(xlabel="tokens emitted per target pass", ylabel="steps", title="τ per decoding step")
    fig.tight_layout()
    with atomic_open(out / "tau_histogram.png") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)

    sets = report["by_dataset"]
    if len(sets) > 1:  # τ against the input it was decoded after: eval's per set, and each engine's beside it
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = [block["prompt_tokens_mean"] for block in sets.values()]
        ax.plot(x, [block["acceptance_length"] for block in sets.values()], "o-", label="eval")
        for name, served in (report.get("engines") or {}).items():
            points = [(block["prompt_tokens_mean"], served["by_dataset"][set_name]["acceptance_length"])
                      for set_name, block in sets.items()
                      if not served.get("failed") and (served["by_dataset"].get(set_name) or {}).get(
                          "acceptance_length") is not None]
            if points:
                ax.plot(*zip(*points, strict=True), "s--", label=name)
        ax.set(xscale="log", xlabel="mean input tokens a turn (log)", ylabel="τ", title="τ by input length")
        ax.legend()
        fig.tight_layout()
        with atomic_open(out / "tau_by_input_length.png") as f:
            fig.savefig(f, format="png", dpi=120)
        plt.close(fig)
