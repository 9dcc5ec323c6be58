import json
import os
import sys
from pathlib import Path

import pytest

# The suite runs on three pytest-xdist workers (pyproject's addopts) on a CI machine's two cores: each worker and
# every process it starts computes on one thread, and a third worker fills the time the other two spend waiting on
# a server to start or a subprocess to import torch (measured: 6 % less time than two workers).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

FILE_SECONDS = Path(__file__).parent / "file_seconds.json"  # measured: scripts/suite_order.py writes it


def pytest_collection_modifyitems(config, items):
    """The longest files first. The workers take whole files in collection order (--dist loadfile, and
    --no-loadscope-reorder: by default xdist puts the files with the most tests first, so the slowest files, which
    hold one or two tests each, came last, and the fleet test started 29 minutes into a 31-minute run). A file not
    measured yet counts as long: a new slow file never lands last."""
    seconds = json.loads(FILE_SECONDS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))  # stable: a file's order kept


from tests.forked_cli import run_cli  # noqa: E402 — after OMP_NUM_THREADS above: its server inherits it


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(autouse=True)
def the_environment_as_the_test_found_it():
    """Whatever a test's in-process code puts in os.environ (a library's setdefault, tokenize's
    TOKENIZERS_PARALLELISM) ends with the test. Left behind, it made every later `flashdraft` command on that worker
    differ from the forked server's environment, so each started a fresh interpreter: seconds of imports, hundreds
    of times (tests/forked_cli.py)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


# ------------------------------------------------------------------------------------------- SeaweedFS


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS `weed mini`) on 127.0.0.1, free ports, for the whole session."""
    from tests.servers import seaweed_server

    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def s3env(seaweed, monkeypatch, tmp_path):
    """Environment pointing the standard AWS chain at the test server (and away from any ~/.aws)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("FLASHDRAFT_S3_ATTEMPTS", "3")
    return seaweed


# ------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded target as an HF directory (converted once into the flashdraft cache, then verified)."""
    from flashdraft.model.resolve import resolve_model

    return resolve_model("embedded", log=lambda s: None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> str:
    """A random-weight Llama of SmolLM2's vocabulary and chat template: real code paths, milliseconds a step."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    """A random-weight Qwen3 of 128 tokens and 6 layers: the drafter and trainer tests' target."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """12 random sequences of 40–51 tokens in `tiny_target`'s vocabulary, all but 8 supervised: a dataset artifact."""
    import torch

    from tests.train.test_train import make_dataset

    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 120, (40 + i,), generator=g).tolist() for i in range(12)]
    return make_dataset(tmp_path_factory.mktemp("ds") / "ds", sequences)


# Qwen3.5/3.6's template in the parts that decide the mask: thinking turns render as <think>…</think> ahead of
# the answer, the generation prompt opens a think block (or, with thinking off, an empty one), <|im_end|> ends
# a turn. Written from the real template's structure; no network.
QWEN3_5_STYLE = """
{%- for message in messages %}
  {%- if message.role == "assistant" %}
    {{- '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '').strip('\\n') + '\\n</think>\\n\\n'
        + message.content.lstrip('\\n') + '<|im_end|>\\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
  {%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


@pytest.fixture(scope="session")
def qwen3_5_template() -> str:
    return QWEN3_5_STYLE


# Qwen3's template in the parts that decide masks with tools (written from its structure; no network): tool
# schemas in the system turn, an assistant's tool calls as <tool_call> JSON inside its turn, tool results as
# user-side <tool_response> turns, a think block on every assistant turn after the last user query (empty when
# thinking is off, which the generation prompt opens too).
QWEN3_TOOLS_TEMPLATE = (
    "{% set ns = namespace(last=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last %}<think>\n{{ (m.reasoning_content or '') | trim }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny random-weight model with the Qwen3-style tools-and-thinking template."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-tools") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN3_TOOLS_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)
