"""τ at temperature > 0 is a random variable: its standard error, and whether an engine's τ agrees with eval's.

A draw is one prompt's conversation under one seed: its accepted drafts A and its verify passes D. τ over a set of
draws is 1 + ΣA / ΣD, a ratio, so its standard error is the ratio estimator's (Cochran, Sampling Techniques §6.3):

    SE(τ) = sqrt(Σ (A_i − R·D_i)² / (n (n − 1))) / mean(D),  R = ΣA / ΣD

over the n draws. Prompts × seeds gives many more draws than the 2–4 seeds alone, whose own standard deviation is
itself very noisy (each seed's τ is still reported, beside it). eval's draws and an engine's are independent (each
samples with its own generator), so the two standard errors combine as sqrt(SE₁² + SE₂²).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

AGREEMENT_FLOOR = 0.04  # τ closer than this agree however many draws there are: the engines round, sample, batch
# a true difference of (1.96 + 0.84) combined standard errors is found 4 times in 5 by a two-sided 5 % test
DETECTABLE_IN_SE = 2.8


def tau_error(draws: Iterable[tuple[float, float]]) -> dict[str, Any] | None:
    """τ and its standard error over (accepted, verify passes) draws; None with fewer than two draws that verified."""
    kept = [(a, d) for a, d in draws if d > 0]
    if len(kept) < 2:
        return None
    n, accepted, passes = len(kept), sum(a for a, _ in kept), sum(d for _, d in kept)
    ratio = accepted / passes
    se = (sum((a - ratio * d) ** 2 for a, d in kept) / (n * (n - 1))) ** 0.5 / (passes / n)
    return {"tau": round(1 + ratio, 4), "standard_error": round(se, 4), "draws": n}


def eval_draws(rows: list[dict]) -> list[tuple[float, float]]:
    """eval's own turns grouped into draws: a prompt's turns under one seed (a later turn follows the earlier
    answer, so turns are not independent draws)."""
    draws: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        draw = draws[(row.get("dataset"), row["id"], row.get("seed"))]
        draw[0] += sum(row["accepted"])
        draw[1] += len(row["accepted"])
    return [tuple(d) for d in draws.values()]


def engine_draws(rows: list[dict]) -> list[tuple[float, float]]:
    """An engine's answers (a row a conversation and seed, with the draft counts its counters gave)."""
    return [(row["accepted"], row["drafts"]) for row in rows]


def add_engine_errors(engine: dict[str, Any]) -> None:
    """Each of an engine's τ (overall, by set, by category) with its standard error over its draws."""
    rows = engine.get("prompts") or []
    if engine.get("overall"):
        engine["overall"]["standard_error"] = _se(tau_error(engine_draws(rows)))
    for name, block in engine.get("by_dataset", {}).items():
        mine = [row for row in rows if row["dataset"] == name]
        block["standard_error"] = _se(tau_error(engine_draws(mine)))
        for category, inner in block.get("by_category", {}).items():
            inner["standard_error"] = _se(tau_error(engine_draws([r for r in mine if r["category"] == category])))


def _se(error: dict[str, Any] | None) -> float | None:
    return error["standard_error"] if error else None


def over_seeds_spread(taus: dict) -> dict[str, Any] | None:
    """τ measured once a seed: each seed's, their mean, standard deviation and standard error of the mean."""
    values = {str(seed): round(tau, 4) for seed, tau in taus.items() if tau is not None}
    if len(values) < 2:
        return None
    mean, std = statistics.fmean(values.values()), statistics.stdev(values.values())
    return {"by_seed": values, "mean": round(mean, 4), "std": round(std, 4),
            "standard_error": round(std / len(values) ** 0.5, 4), "n": len(values)}


def judged(engine_tau: float | None, engine_se: float | None, ours_tau: float | None,
           ours_se: float | None) -> dict[str, Any] | None:
    """An engine's τ against eval's at temperature > 0: the difference, the bound it is judged by (2 combined
    standard errors over prompts × seeds, or AGREEMENT_FLOOR, whichever is larger), whether it is within, and the
    smallest true difference the run would have found 4 times in 5. None where either has no standard error."""
    if None in (engine_tau, engine_se, ours_tau, ours_se):
        return None
    combined = (engine_se ** 2 + ours_se ** 2) ** 0.5
    bound = max(2 * combined, AGREEMENT_FLOOR)
    difference = engine_tau - ours_tau
    return {"difference": round(difference, 4), "combined_standard_error": round(combined, 4),
            "bound": round(bound, 4), "agrees": abs(difference) <= bound,
            "detectable": round(DETECTABLE_IN_SE * combined, 4),
            "standard_error_over": "prompts × seeds (a prompt's conversation under one seed is one draw)"}
