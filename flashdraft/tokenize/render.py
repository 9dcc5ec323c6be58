"""The target's chat template, rendered exactly as serving renders it, and the character spans of the
assistant turns to train on (from render boundaries: turns [:i] + generation prompt is a prefix of turns [:i+1])."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.errors import BadInput
from flashdraft.model.resolve import stop_token_ids
from flashdraft.records import BadRecord
from flashdraft.tokenize.offsets import ByteLengths


@dataclass
class Renderer:
    """The target's chat template, and the character spans of the assistant turns to train on."""

    tokenizer: Any
    stop_ids: set[int]
    reasoning_in_template: bool
    byte_lengths: ByteLengths | None  # token positions from ids alone (byte-level BPE); else offsets
    compiled: Any = None  # the template as apply_chat_template compiles it, when rendering it directly is exact
    variables: dict[str, Any] = field(default_factory=dict)  # what apply_chat_template passes besides messages

    @classmethod
    def load(cls, path: str) -> Renderer:
        # PreTrainedTokenizerFast, not AutoTokenizer: the same tokenizer.json and chat template, without
        # importing torch (seconds per worker process).
        from transformers import PreTrainedTokenizerFast

        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise BadInput(f"{path}: flashdraft needs a fast tokenizer (tokenizer.json) for offsets: {e}") from None
        generation = Path(path) / "generation_config.json"  # read as JSON: no torch import in workers
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        template = tokenizer.chat_template or ""
        renderer = cls(
            tokenizer,
            stop_token_ids(tokenizer, eos),
            "reasoning_content" in template,
            ByteLengths.for_tokenizer(tokenizer.backend_tokenizer),
        )
        renderer.variables = dict(tokenizer.special_tokens_map)
        renderer.compiled = renderer._direct_template()
        return renderer

    def _direct_template(self) -> Any:
        """`apply_chat_template` spends over half its time outside the template (normalizing messages already
        plain here, recomputing the special-token map): ~0.05 ms of ~0.1 ms a render, two renders a sample.
        Rendering transformers' own compiled template with the same variables is exact; it is used only if a
        probe conversation renders identically both ways, else every render goes through apply_chat_template."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.tokenizer.get_chat_template())
        except Exception:  # a private helper: any change in a later transformers means the public path
            return None
        probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&</b>"},
                 {"role": "assistant", "content": "Hello.", "reasoning": "greet"}, {"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "4", "reasoning": "add"}]
        for thinking in (False, True):
            for generation_prompt, messages in ((True, probe[:4]), (False, probe)):
                turns = self.template_messages(messages)
                try:
                    direct = self._render_direct(compiled, turns, thinking, generation_prompt)
                    public = self.tokenizer.apply_chat_template(
                        turns, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
                    )
                except Exception:
                    return None
                if direct != public:
                    return None
        return compiled

    def _render_direct(self, compiled: Any, turns: list[dict[str, Any]], thinking: bool, gen_prompt: bool,
                       tools: list[dict[str, Any]] | None = None) -> str:
        # apply_chat_template also shows a turn's reasoning_content to templates that read `thinking` (gpt-oss)
        turns = [{"thinking": t["reasoning_content"], **t} if "reasoning_content" in t else t for t in turns]
        return compiled.render(
            messages=turns, tools=tools, documents=None, add_generation_prompt=gen_prompt,
            **self.variables, enable_thinking=thinking,
        )

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Reasoning goes where the template puts it: `reasoning_content` if the template reads it (Qwen3
        family, which drops earlier turns' reasoning itself), else a think block ahead of the final answer."""
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out = []
        for i, m in enumerate(messages):
            turn = {k: v for k, v in m.items() if k != "reasoning"}  # role, content and any tool fields
            if m["role"] == "assistant" and self.reasoning_in_template:
                turn["reasoning_content"] = m.get("reasoning", "") if i == last else ""
            elif i == last and m.get("reasoning"):
                turn["content"] = f"<think>\n{m['reasoning'].strip()}\n</think>\n\n{m['content']}"
            out.append(turn)
        return out

    def render(self, messages: list[dict[str, Any]], thinking: bool, generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        if self.compiled is not None:
            return self._render_direct(self.compiled, messages, thinking, generation_prompt, tools)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
        )

    def spans(self, messages: list[dict[str, Any]], thinking: bool, final_only: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list, str, list]:
        """(full text, [(start, end)] of trained turns, the final turn's prompt text, own samples).
        A trained turn's span is all the template renders for it — its tool calls included; tool results are
        their own (`tool`) turns and never trained on. A turn the template renders differently once later turns
        follow (Qwen3 drops an earlier turn's reasoning) cannot be masked in the full text: it becomes its own
        sample — the conversation through that turn, rendered as when the target produced it — listed as
        (turn index, text, span, prompt text)."""
        msgs = self.template_messages(messages)
        full = self.render(msgs, thinking, tools=tools)
        assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        trained = assistant[-1:] if final_only else assistant
        spans, own, prompt_text = [], [], ""
        for i in trained:
            before = self.render(msgs[:i], thinking, generation_prompt=True, tools=tools)
            through = full if i == len(msgs) - 1 else self.render(msgs[: i + 1], thinking, tools=tools)
            if full.startswith(through) and through.startswith(before):
                spans.append((len(before), len(through)))
                prompt_text = before
                continue
            if i == assistant[-1]:
                raise BadRecord(f"chat template renders turn {i} differently in context; cannot place its mask")
            alone = self.template_messages(messages[: i + 1])  # turn i last: with its own reasoning
            text = self.render(alone, thinking, tools=tools)
            before = self.render(alone[:i], thinking, generation_prompt=True, tools=tools)
            if not text.startswith(before):
                raise BadRecord(f"chat template renders turn {i}'s prompt differently; cannot place its mask")
            own.append((i, text, (len(before), len(text)), before))
        return full, spans, prompt_text, own
