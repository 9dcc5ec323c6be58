"""A DSpark drafter in the engines (llama.cpp's `draft-dspark`): served and accepting what eval accepts, and a Markov
head the engines cannot run refused before any work. Apart from test_engines.py so that their slow fixtures build on
different workers. Needs `scripts/engines.sh`."""

import json

import pytest

from tests.evaluate.test_engines import PROMPTS, agreeing_drafter, needs_llamacpp


@pytest.fixture(scope="module")
def dspark_export(tmp_path_factory, smollm2_dir):
    """A DSpark drafter (vanilla Markov head, confidence head, the same draft vocabulary), trained as above and
    exported in DeepSpec's native format, and the prompts."""
    from transformers import AutoTokenizer

    from flashdraft.model.export import save_drafter

    where = tmp_path_factory.mktemp("dspark")
    drafter, head = agreeing_drafter(smollm2_dir, AutoTokenizer.from_pretrained(smollm2_dir), steps=60, dspark=True)
    save_drafter(drafter, where / "drafter", target_lm_head=head)
    prompts = where / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    return where / "drafter", prompts


@pytest.mark.slow
@needs_llamacpp
def test_llamacpp_serves_a_dspark_export_and_accepts_what_eval_accepts(tmp_path, smollm2_dir, dspark_export):
    """llama.cpp's `draft-dspark` on the native export (converted by its own DSpark class, the Markov head in its
    graph): K drafts a step, the anchor's slot included, and eval's accepted drafts within a tenth."""
    from flashdraft.config import EvalConfig
    from flashdraft.evaluate import run

    drafter_dir, prompts = dspark_export
    out = tmp_path / "eval"
    cfg = EvalConfig(prompts=str(prompts), target=smollm2_dir, max_new_tokens=48, engine="llamacpp",
                     engine_baseline=False)
    stats = run(cfg, drafter_dir, out, log=print)
    report = json.loads((out / "report.json").read_text())
    steps = [p["accepted"] for p in report["prompts"]]
    accepted, passes = sum(map(sum, steps)), sum(map(len, steps))
    assert stats["lossless"] is True and accepted >= 5, (accepted, passes)
    assert report["dspark"]["mean_proposed"] == 4.0  # uncut: every slot of the block of 4 is sent
    served = stats["engines"]["llamacpp"]["overall"]
    assert abs(served["accepted_tokens"] - accepted) <= max(2, accepted // 10), (served, accepted)
    assert abs(served["drafts"] - passes) <= 3, (served, passes)
    assert served["draft_tokens"] > 3 * served["drafts"]  # more than DFlash's K − 1 a step: the anchor slot drafts
    assert abs(served["acceptance_length"] - stats["acceptance_length"]) <= 0.1

    # the engine alone (eval.engine_only: minutes on a served engine, no in-process decoding): the same τ there
    alone = run(cfg.model_copy(update={"engine_only": True}), drafter_dir, tmp_path / "alone", log=print)
    assert alone["engine_only"] is True and "acceptance_length" not in alone
    assert abs(alone["engines"]["llamacpp"]["overall"]["acceptance_length"] - served["acceptance_length"]) <= 0.05
    assert "engine only" in (tmp_path / "alone" / "report.md").read_text()


@pytest.mark.slow
@needs_llamacpp
def test_a_markov_head_the_engines_cannot_run_is_refused_before_any_work(cli, tmp_path, smollm2_dir, dspark_export):
    drafter_dir, prompts = dspark_export
    gated = tmp_path / "gated"
    gated.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    (gated / "config.json").write_text(json.dumps({**config, "markov_head_type": "gated"}))
    run = cli("export", "--format", "gguf", "--drafter", str(gated), "--target", smollm2_dir, "--out",
              str(tmp_path / "g"))
    assert run.returncode == 1 and "Traceback" not in run.stderr and "serve vanilla only" in run.stderr
    assert not (tmp_path / "g").exists()


