import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdraft.demo import DEMO_SETTINGS
from flashdraft.errors import BadInput
from flashdraft.generate.prompts import in_shard, load_prompts, normalize, prompt_id, templated_like


def write_jsonl(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return str(path)


def test_record_forms_normalize_to_messages():
    openai_form = normalize(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    )
    sharegpt = normalize(
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}]}
    )
    assert openai_form.messages == sharegpt.messages and openai_form.id == sharegpt.id
    bare = normalize({"prompt": "Hi", "category": "chat"})
    assert bare.messages == [{"role": "user", "content": "Hi"}] and bare.category == "chat"


def test_final_assistant_turn_is_regenerated_from_history():
    p = normalize({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "old A"}]})
    assert p.messages == [{"role": "user", "content": "Q"}]
    multi = normalize({"conversations": [{"from": "human", "value": "1"}, {"from": "gpt", "value": "2"},
                                         {"from": "human", "value": "3"}, {"from": "gpt", "value": "4"}]})
    assert [m["content"] for m in multi.messages] == ["1", "2", "3"]


def test_every_bad_input_kind_is_rejected_with_line_and_reason(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [
        '{"prompt": "good one"}',
        '{"messages": [{"role": "user", "content": "broken"}',       # 2 malformed JSON
        '{"messages": []}',                                           # 3 empty messages
        '{"other": 1}',                                               # 4 missing messages
        '{"messages": [{"role": "wizard", "content": "x"}]}',       # 5 unknown role
        '{"messages": [{"role": "user", "content": ["a", "b"]}]}',  # 6 non-string content
        b'{"prompt": "caf\xe9"}',                                     # 7 not UTF-8
        '',
        '{"messages": [{"role": "assistant", "content": "only me"}]}',  # 9 nothing to answer
        '[1, 2]',                                                     # 10 not an object
        '{"prompt": "good one"}',                                     # 11 duplicate
    ])
    loaded = load_prompts(src)
    assert [p.messages[0]["content"] for p in loaded.prompts] == ["good one"]
    assert loaded.duplicates == 1
    reasons = {r.line: r.reason for r in loaded.rejected}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 9, 10]
    assert reasons[2].startswith("malformed JSON")
    assert reasons[3] == "messages are missing or empty"
    assert "no `messages`" in reasons[4]
    assert "unknown role 'wizard'" in reasons[5]
    assert "not a string" in reasons[6]
    assert reasons[7].startswith("not UTF-8")
    assert "nothing to answer" in reasons[9]
    assert "not an object" in reasons[10]
    assert json.loads(json.dumps(loaded.rejected[0].to_json()))["raw"].startswith('{"messages"')


def test_parquet_and_save_to_disk_sources(tmp_path):
    rows = [{"prompt": f"q{i}"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert len(load_prompts(str(tmp_path / "p.parquet")).prompts) == 5

    from datasets import Dataset

    Dataset.from_list([{"messages": [{"role": "user", "content": f"m{i}"}]} for i in range(4)]).save_to_disk(
        str(tmp_path / "ds")
    )
    assert [p.messages[0]["content"] for p in load_prompts(str(tmp_path / "ds")).prompts] == ["m0", "m1", "m2", "m3"]


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(BadInput, match="prompts not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(BadInput, match="unknown built-in"):
        load_prompts("builtin:nope")


def test_builtin_demo_sets_are_large_varied_and_disjoint():
    demo, heldout = load_prompts("builtin:demo"), load_prompts("builtin:demo-heldout")
    assert len(demo.prompts) >= 400 and demo.duplicates == 0 and not demo.rejected
    assert {p.category for p in demo.prompts} == {"math", "code", "explain", "writing"}
    assert len(heldout.prompts) == 60
    assert not {p.id for p in demo.prompts} & {p.id for p in heldout.prompts}
    assert [p.id for p in load_prompts("builtin:demo").prompts] == [p.id for p in demo.prompts]  # stable


@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_shards_cover_every_prompt_exactly_once(num_shards):
    ids = [p.id for p in load_prompts("builtin:demo").prompts]
    taken = [i for shard in range(num_shards) for i in ids if in_shard(i, shard, num_shards)]
    assert sorted(taken) == sorted(ids)
    if num_shards > 1:
        sizes = [sum(in_shard(i, s, num_shards) for i in ids) for s in range(num_shards)]
        assert min(sizes) > len(ids) / num_shards / 2  # roughly balanced


def test_prompt_id_is_content_hash():
    a = prompt_id([{"role": "user", "content": "x"}])
    assert a == prompt_id([{"content": "x", "role": "user"}]) and a != prompt_id([{"role": "user", "content": "y"}])


def test_builtin_chat_heldout_shares_no_template_with_training():
    train, heldout = load_prompts("builtin:chat"), load_prompts("builtin:chat-heldout")
    assert len(train.prompts) >= 100 and len(heldout.prompts) >= 40 and not train.rejected and not heldout.rejected
    categories = {p.category for p in heldout.prompts}
    assert {"math", "code", "explain", "writing"} <= categories
    assert any(len(p.messages) > 1 for p in train.prompts)  # some multi-turn and system-prompted records
    assert templated_like(train.prompts, heldout.prompts) == []
    # The check can fail: the templated demo sets share openings throughout.
    demo, demo_heldout = load_prompts("builtin:demo"), load_prompts("builtin:demo-heldout")
    assert len(templated_like(demo.prompts, demo_heldout.prompts)) > len(demo_heldout.prompts) // 2


def test_the_first_chat_prompts_cover_every_kind_and_sets_join_with_plus():
    heldout = load_prompts("builtin:chat-heldout").prompts
    assert {p.category for p in heldout[:4]} == {"math", "code", "explain", "writing"}  # a short eval sees all
    joined = load_prompts("builtin:chat+demo")
    chat, demo = load_prompts("builtin:chat"), load_prompts("builtin:demo")
    assert [p.id for p in joined.prompts] == [p.id for p in chat.prompts + demo.prompts]
    assert templated_like(joined.prompts, heldout) == []


def test_what_the_demo_trains_on_shares_no_template_with_what_it_is_judged_on():
    trained = load_prompts(DEMO_SETTINGS["generate.prompts"])
    judged = load_prompts(DEMO_SETTINGS["eval.prompts"]).prompts[: DEMO_SETTINGS["eval.max_prompts"]]
    assert len(trained.prompts) == DEMO_SETTINGS["generate.max_prompts"] and not trained.rejected  # all of them
    assert templated_like(trained.prompts, judged) == []
    more = load_prompts("builtin:chat-more").prompts
    assert len(more) == 1153 and {p.category for p in more[:4]} == {"math", "code", "explain", "writing"}
    assert not {p.id for p in more} & {p.id for p in load_prompts("builtin:chat").prompts}


def test_chat_extra_is_new_hand_written_prompts_no_held_out_one_is_templated_from():
    """`builtin:chat-extra` adds distinct prompts (the data lever): none repeats a `chat` / `chat-more` prompt,
    and none shares an opening or a third of its 4-grams with a held-out prompt."""
    extra = load_prompts("builtin:chat-extra")
    assert len(extra.prompts) == 2082 and not extra.rejected
    assert {p.category for p in extra.prompts[:4]} == {"math", "code", "explain", "writing"}
    earlier = load_prompts("builtin:chat+chat-more").prompts
    assert not {p.id for p in extra.prompts} & {p.id for p in earlier}
    heldout = load_prompts("builtin:chat-heldout").prompts
    assert templated_like(extra.prompts, heldout) == [] and templated_like(heldout, extra.prompts) == []


def test_eval_measures_by_default_on_prompts_no_shipped_training_set_shares_a_template_with():
    """`flashdraft eval` without --prompts: τ on hand-written prompts, not on the demo set's own templates."""
    from flashdraft.config import EvalConfig, GenerateConfig

    judged = load_prompts(EvalConfig().prompts).prompts
    for trained in (GenerateConfig().prompts, "builtin:chat+chat-more+chat-extra+demo"):
        assert templated_like(load_prompts(trained).prompts, judged) == [], trained
    assert templated_like(load_prompts("builtin:demo").prompts, load_prompts("builtin:demo-heldout").prompts)


def test_generate_reads_prompts_in_two_streaming_passes_that_must_agree(tmp_path):
    """generate holds ids, not prompts: pass 1 batches the ids, pass 2 reads each batch still to do as the
    stream reaches it. A file changed between the two is one clear error, not batches of other prompts."""
    from flashdraft.config import GenerateConfig
    from flashdraft.generate.batches import batch_ids, batch_prompts
    from flashdraft.generate.prompts import PromptSet

    src = tmp_path / "p.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in range(10)]
    src.write_text("\n".join(lines + ["not json", lines[3]]) + "\n")
    cfg = GenerateConfig(prompts=str(src), batch_size=4, max_prompts=9)
    tally = PromptSet()
    batches = batch_ids(cfg, tally, log=lambda s: None)
    assert [len(b) for b in batches] == [4, 4, 1] and tally.prompts == []  # max_prompts 9, ids only
    assert tally.duplicates == 1 and len(tally.rejected) == 1 and tally.valid == 10
    expected = {p.id: p for p in load_prompts(str(src)).prompts}
    got = dict(batch_prompts(cfg, batches, {0, 2}))  # batch 1 already committed: not read into memory
    assert sorted(got) == [0, 2]
    assert [p.id for p in got[0]] == batches[0] and [p.messages for p in got[2]] == [expected[batches[2][0]].messages]

    src.write_text("\n".join(lines[:8] + lines[9:]) + "\n")  # batch 2's prompt is gone
    with pytest.raises(BadInput, match="changed while generate ran"):
        list(batch_prompts(cfg, batches, {2}))


def test_every_built_in_set_is_a_data_file_with_the_ids_and_order_it_had_as_code():
    """Issue 48: the sets moved from Python literals to prompt_sets/*.jsonl; the ids of every set, in order, are
    those the code produced (pinned in tests/assets/builtin_prompt_ids.json before the move)."""
    import hashlib
    import json
    from pathlib import Path

    from flashdraft.generate.prompts import builtin_sets

    pinned = json.loads((Path(__file__).parents[1] / "assets" / "builtin_prompt_ids.json").read_text())
    assert set(builtin_sets()) | {"chat+chat-more+chat-extra"} == set(pinned)
    for name, expected in pinned.items():
        ids = [p.id for p in load_prompts(f"builtin:{name}").prompts]
        assert {"prompts": len(ids), "ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()} == expected
    files = Path(__file__).parents[2] / "flashdraft" / "generate" / "prompt_sets"
    for name in builtin_sets():  # one record a line, each with its kind
        records = [json.loads(line) for line in (files / f"{name}.jsonl").read_text().splitlines()]
        assert records and all(("prompt" in r) != ("messages" in r) and r["category"] for r in records)
