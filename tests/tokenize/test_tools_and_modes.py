"""Agent traces and mixed thinking modes: tools rendered in the template's own format, the assistant's tool
calls trained on and the tool results not (token-exactly), each record rendered in its own thinking mode."""

import json
from pathlib import Path

from datasets import load_from_disk
from transformers import AutoTokenizer

from flashdraft.config import GenerateConfig
from flashdraft.generate.backends import HFBackend
from flashdraft.generate.prompts import normalize

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": WEATHER}}]
TRACE = {
    "tools": TOOLS,
    "thinking": False,
    "messages": [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "RAINY-14C"},
        {"role": "assistant", "content": "It is rainy and 14 degrees in Paris."},
    ],
}


def tokenize(cli, tmp_path: Path, model_dir: str, rows: list[dict]):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dataset"
    cli("tokenize", "--input", str(src), "--out", str(out), "--tokenizer", model_dir, "--workers", "1",
        "--min-loss-fraction", "0", "--block-size", "4", check=True)
    return load_from_disk(str(out))


def expected_mask(tokenizer, messages: list[dict], tools, thinking: bool) -> tuple[list[int], list[int]]:
    """Independently of flashdraft: the template's text of each assistant turn — from the end of the prompt the
    template renders before it to the end of the conversation rendered through it — as token positions."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen,
                                             enable_thinking=thinking)

    full = render(messages, False)
    trained = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
            trained.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e for s, e in trained)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


def test_tool_calls_are_trained_on_and_tool_results_are_not(cli, tmp_path, tools_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    sample = tokenize(cli, tmp_path, tools_model_dir, [TRACE])[0]
    ids, mask = expected_mask(tokenizer, TRACE["messages"], TOOLS, thinking=False)
    assert sample["input_ids"] == ids
    # flashdraft supervises the same tokens, except that it leaves the turn-closing newline after <|im_end|>
    # (a stop token) unsupervised: serving stops there.
    differs = [i for i, (a, b) in enumerate(zip(sample["loss_mask"], mask, strict=True)) if a != b]
    assert all(tokenizer.decode([ids[i]]) == "\n" and tokenizer.decode([ids[i - 1]]) == "<|im_end|>" for i in differs)
    supervised = tokenizer.decode([t for t, m in zip(ids, sample["loss_mask"], strict=True) if m])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in supervised
    assert "It is rainy and 14 degrees in Paris." in supervised
    assert "RAINY-14C" not in supervised and "tool_response" not in supervised and "get_weather" in supervised
    assert "Weather for a city" not in supervised  # the tool schemas are prompt, not answer
    assert "Weather for a city" in tokenizer.decode(ids)


def test_each_record_is_rendered_in_its_own_thinking_mode(cli, tmp_path, tools_model_dir):
    def chat(i, thinking):
        answer = {"role": "assistant", "content": f"Answer {i}."}
        if thinking:
            answer["reasoning_content"] = f"Let me think about {i}."
        return {"thinking": thinking, "messages": [{"role": "user", "content": f"Question {i}?"}, answer]}

    rows = [chat(i, i % 2 == 0) for i in range(4)]
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    for sample in tokenize(cli, tmp_path, tools_model_dir, rows):
        i = next(k for k in range(4) if f"Question {k}?" in tokenizer.decode(sample["input_ids"]))
        text = tokenizer.decode(sample["input_ids"])
        supervised = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"], strict=True) if m])
        if i % 2 == 0:  # thinking on: the reasoning is the model's own output, trained on
            assert f"<think>\nLet me think about {i}.\n</think>" in supervised
        else:  # thinking off: the template's empty think block is prompt (serving opens it), not trained on
            assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in text and "<think>" not in supervised
        assert f"Answer {i}." in supervised


def test_generate_sends_a_record_s_tools_to_the_template(tools_model_dir):
    prompt = normalize({**TRACE, "messages": TRACE["messages"][:4]})  # ends with the tool result: answer it
    assert prompt.tools == TOOLS and prompt.messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    text = HFBackend(GenerateConfig(model=tools_model_dir), log=lambda s: None).render(prompt)
    assert '"name": "get_weather"' in text and "<tools>" in text and "<tool_response>\nRAINY-14C" in text
    assert normalize({**TRACE, "tools": None}).id != prompt.id
