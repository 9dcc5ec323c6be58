"""Generation backends for `generate`: each turns a list of prompts into one Completion per prompt.

    hf      transformers, batched with left padding, CPU or GPU (the embedded default)
    openai  any OpenAI-compatible chat-completions server (vLLM, SGLang, `transformers serve`), async
    vllm    in-process `vllm.LLM` (GPU machines; optional import)

A backend never raises for one bad request: the Completion carries `error`, and the stage writes it to
errors.jsonl. Reasoning is split from the answer here, so every backend stores them the same way.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from flashdraft.config import EMBEDDED_TARGET, GenerateConfig
from flashdraft.errors import BadInput
from flashdraft.generate.prompts import Prompt
from flashdraft.redact import redact

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Completion:
    content: str = ""
    reasoning: str | None = None
    finish_reason: str = "stop"  # stop | length | error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] | None = None
    stray_think_markers: int = 0
    error: str | None = None
    # OpenAI form, as a server parsed them (openai backend). The hf and vllm backends keep the model's tool-call
    # markup in `content`: re-rendered as content it gives back exactly the tokens the model produced.
    tool_calls: list[dict[str, Any]] | None = None


def split_reasoning(text: str, reasoning: str | None = None) -> tuple[str | None, str, int]:
    """(reasoning, content, stray markers). Handles `<think>…</think>answer` and, when the chat template
    opened the think block in the prompt, `…</think>answer`. Markers left over afterwards are stray."""
    if reasoning is None and THINK_CLOSE in text:
        before, _, after = text.partition(THINK_CLOSE)
        reasoning = before.split(THINK_OPEN, 1)[1] if THINK_OPEN in before else before
        reasoning, text = reasoning.strip(), after.lstrip()
    stray = sum(part.count(THINK_OPEN) + part.count(THINK_CLOSE) for part in (text, reasoning or ""))
    return reasoning, text, stray


def make_backend(cfg: GenerateConfig, log=print):
    if cfg.backend == "hf":
        return HFBackend(cfg, log)
    if cfg.backend == "openai":
        return OpenAIBackend(cfg, log)
    return VLLMBackend(cfg, log)


# ---------------------------------------------------------------------------------------------- hf


_CONTEXTS: dict[str, tuple[Any, int | None]] = {}


def _context_of(model: str, log) -> tuple[Any, int | None]:
    """The hf target's tokenizer and context length, loaded once however many chunks of prompts are checked."""
    if model not in _CONTEXTS:
        from transformers import AutoConfig, AutoTokenizer

        from flashdraft.model.resolve import resolve_model

        path = resolve_model(model, log=log)
        config = AutoConfig.from_pretrained(path)
        context = getattr(getattr(config, "text_config", config), "max_position_embeddings", None)
        _CONTEXTS[model] = (AutoTokenizer.from_pretrained(path) if context is not None else None), context
    return _CONTEXTS[model]


def context_rejections(cfg: GenerateConfig, prompts: list[Prompt], log=print) -> dict[str, str]:
    """hf backend: the prompts whose rendered tokens plus max_new_tokens exceed the target's context, each with
    the reason. They are rejected before generation (a model past its context writes garbage, not an error).
    Other backends: the server checks, and a request it refuses is an error record."""
    if cfg.backend != "hf" or not prompts:
        return {}
    tokenizer, context = _context_of(cfg.model, log)
    if context is None:
        return {}
    rejected = {}
    for prompt in prompts:
        text = tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools, add_generation_prompt=True,
                                             tokenize=False, enable_thinking=prompt.thinking)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > context:
            rejected[prompt.id] = (f"prompt is {n} tokens; with max_new_tokens {cfg.max_new_tokens} it exceeds the "
                                   f"target's context of {context} tokens")
    return rejected


class HFBackend:
    def __init__(self, cfg: GenerateConfig, log=print) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flashdraft.cpu_bfloat16 import bfloat16_notice
        from flashdraft.model.resolve import resolve_model, stop_token_ids
        from flashdraft.model.target import weight_dtype

        self.cfg = cfg
        path = resolve_model(cfg.model, log=log)
        self.model_name = cfg.model if cfg.model != EMBEDDED_TARGET else "SmolLM2-135M-Instruct"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = weight_dtype(cfg.dtype, device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        if dtype == torch.bfloat16 and (notice := bfloat16_notice(device)):
            log(f"generate: generate.dtype bfloat16 — {notice}")
        self.eos_ids = stop_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        self.device = device

    def render(self, prompt: Prompt) -> str:
        return self.tokenizer.apply_chat_template(
            prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=False,
            enable_thinking=prompt.thinking,
        )

    def complete(self, prompts: list[Prompt], seed: int = 0) -> list[Completion]:
        import torch

        texts = [self.render(p) for p in prompts]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sampling = self.cfg.temperature > 0
        torch.manual_seed(seed)  # a resumed batch samples what the first attempt would have
        with torch.inference_mode():
            out = self.model.generate(
                **batch,
                max_new_tokens=self.cfg.max_new_tokens,
                do_sample=sampling,
                temperature=self.cfg.temperature if sampling else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=sorted(self.eos_ids),
            )
        prompt_lengths = batch["attention_mask"].sum(dim=1).tolist()
        generated = out[:, batch["input_ids"].shape[1] :].tolist()
        return [self._completion(ids, n) for ids, n in zip(generated, prompt_lengths, strict=True)]

    def _completion(self, ids: list[int], prompt_tokens: int) -> Completion:
        stop = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
        # The end-of-turn token is kept in token_ids: the drafter learns to predict it too.
        kept = ids[: stop + 1] if stop is not None else ids
        text = self.tokenizer.decode(kept[:-1] if stop is not None else kept, skip_special_tokens=True)
        reasoning, content, stray = split_reasoning(text)
        return Completion(
            content=content,
            reasoning=reasoning,
            finish_reason="stop" if stop is not None else "length",
            prompt_tokens=int(prompt_tokens),
            completion_tokens=len(kept),
            token_ids=kept,
            stray_think_markers=stray,
        )


# ---------------------------------------------------------------------------------------------- openai


class OpenAIBackend:
    """Chat completions against one or more endpoints, round-robin, with bounded concurrency.

    Retries (429, 5xx, timeouts, connection errors; exponential backoff with jitter) are the `openai`
    client's own; a request that still fails becomes an error record.
    """

    def __init__(self, cfg: GenerateConfig, log=print) -> None:
        if importlib.util.find_spec("openai") is None:
            raise BadInput("the openai backend needs the openai package: pip install openai")
        if not cfg.base_urls:
            raise BadInput("the openai backend needs at least one --base-url (e.g. http://host:8000/v1)")
        self.cfg = cfg
        RetryReport.attach(log, cfg)
        self.model_name = cfg.model if cfg.model != EMBEDDED_TARGET else asyncio.run(self._served_model())
        log(f"generate: openai backend, model {self.model_name!r}, {len(cfg.base_urls)} endpoint(s)")

    def _clients(self) -> list[Any]:
        """Fresh clients per event loop (an async client is bound to the loop that first used it)."""
        import openai

        return [
            openai.AsyncOpenAI(
                base_url=url, api_key=_api_key(), max_retries=self.cfg.max_retries, timeout=self.cfg.timeout_s
            )
            for url in self.cfg.base_urls
        ]

    async def _served_model(self) -> str:
        """With no --model, ask the first endpoint what it serves."""
        import openai

        client = self._clients()[0]
        try:
            return (await client.models.list()).data[0].id
        except (openai.OpenAIError, IndexError) as e:
            raise BadInput(f"cannot ask {self.cfg.base_urls[0]} which model it serves ({type(e).__name__}: {e}); "
                           "is the server up? Or pass --model") from None
        finally:
            await client.close()

    def complete(self, prompts: list[Prompt], seed: int = 0) -> list[Completion]:
        return asyncio.run(self._complete_all(prompts, seed))

    async def _complete_all(self, prompts: list[Prompt], seed: int) -> list[Completion]:
        limit = asyncio.Semaphore(self.cfg.concurrency)
        clients = self._clients()
        endpoints = itertools.cycle(clients)
        try:
            return await asyncio.gather(*[self._one(next(endpoints), p, limit, seed) for p in prompts])
        finally:
            for client in clients:
                await client.close()

    async def _one(self, client: Any, prompt: Prompt, limit: asyncio.Semaphore, seed: int) -> Completion:
        import openai

        async with limit:
            try:
                response = await client.chat.completions.create(
                    model=self.model_name,
                    messages=prompt.messages,
                    **({"tools": prompt.tools} if prompt.tools else {}),
                    max_tokens=self.cfg.max_new_tokens,
                    temperature=self.cfg.temperature,
                    seed=seed,
                    extra_body={"chat_template_kwargs": {"enable_thinking": prompt.thinking}},
                )
            except openai.OpenAIError as e:
                return Completion(finish_reason="error", error=redact(f"{type(e).__name__}: {e}"))
        if not response.choices:
            return Completion(finish_reason="error", error="the server returned no choices")
        choice = response.choices[0]
        extra = choice.message.model_extra or {}
        server_reasoning = extra.get("reasoning_content") or extra.get("reasoning")
        reasoning, content, stray = split_reasoning(choice.message.content or "", server_reasoning)
        usage = response.usage
        calls = [{"type": "function", "id": c.id,
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in choice.message.tool_calls or [] if getattr(c, "function", None)]
        return Completion(
            content=content,
            reasoning=reasoning,
            finish_reason=choice.finish_reason or "stop",
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            stray_think_markers=stray,
            tool_calls=calls or None,
        )


class RetryReport(logging.Handler):
    """Makes the openai client's retries visible in the log (at most one line per 10 s, with a count), so a
    server that accepts connections but never answers shows up long before every retry has timed out."""

    def __init__(self, log, cfg: GenerateConfig) -> None:
        super().__init__(logging.INFO)
        self.say, self.cfg, self.count, self.last = log, cfg, 0, 0.0

    @classmethod
    def attach(cls, log, cfg: GenerateConfig) -> None:
        logger = logging.getLogger("openai")
        for old in [h for h in logger.handlers if isinstance(h, cls)]:
            logger.removeHandler(old)
        logger.addHandler(cls(log, cfg))
        logger.setLevel(min(logger.level or logging.INFO, logging.INFO))

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("Retrying request"):
            return
        self.count += 1
        if time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            self.say(f"generate: {self.count} request retries so far ({message}; up to {self.cfg.max_retries} "
                     f"retries of {self.cfg.timeout_s:g} s each per request)")


def _api_key() -> str:
    import os

    # vLLM/SGLang accept any key unless started with --api-key; the key is never logged or written.
    return os.environ.get("OPENAI_API_KEY", "EMPTY")


# ---------------------------------------------------------------------------------------------- vllm


class VLLMBackend:
    def __init__(self, cfg: GenerateConfig, log=print) -> None:
        try:
            from vllm import LLM
        except ImportError:
            raise BadInput(
                "the vllm backend needs vllm (GPU machines): pip install vllm — or use --backend hf / openai"
            ) from None
        from flashdraft.model.resolve import resolve_model

        self.cfg = cfg
        self.model_name = cfg.model
        self.llm = LLM(model=resolve_model(cfg.model, log=log))

    def complete(self, prompts: list[Prompt], seed: int = 0) -> list[Completion]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature, seed=seed)
        outputs = {}
        def mode(p: Prompt) -> tuple[bool, str]:
            return bool(p.thinking), json.dumps(p.tools, sort_keys=True)

        for key in sorted({mode(p) for p in prompts}):  # one chat() per mode and tool set: they are per call
            group = [i for i, p in enumerate(prompts) if mode(p) == key]
            answers = self.llm.chat([prompts[i].messages for i in group], params, use_tqdm=False,
                                    tools=prompts[group[0]].tools, chat_template_kwargs={"enable_thinking": key[0]})
            outputs.update(zip(group, answers, strict=True))
        results = []
        for out in (outputs[i] for i in range(len(prompts))):
            gen = out.outputs[0]
            reasoning, content, stray = split_reasoning(gen.text)
            results.append(
                Completion(
                    content=content,
                    reasoning=reasoning,
                    finish_reason=gen.finish_reason or "stop",
                    prompt_tokens=len(out.prompt_token_ids or []),
                    completion_tokens=len(gen.token_ids),
                    token_ids=list(gen.token_ids),
                    stray_think_markers=stray,
                )
            )
        return results
