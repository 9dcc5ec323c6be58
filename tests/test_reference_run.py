"""The runbook (docs/reference-run.md) and its config (examples/qwen3.6-27b.yaml) on the seeds' own topology.

    gen-0            N servers of the target on consecutive ports (the runbook's loop: port 8000 + GPU index); three
                     `transformers serve` processes of a tiny random-weight Llama (the embedded target's tokenizer and
                     chat template) stand in for the seven
    CPU box          `run CONFIG --until tokenize`: one generate process drives every server, tokenizes, pushes
    training node    an empty disk, `run CONFIG --from train`: pulls the dataset, starts train.nproc_per_node = 2
                     processes itself (two CPU processes stand in for the 2 + 2 GPUs, the example's per-process
                     device entries kept), pushes checkpoints, exports, evaluates, pushes
    status host      `status --config --store`: every stage verified from the store

The config each machine runs is the example itself with only what cannot run here replaced (the model, the sizes,
the devices, the paths); the test says which keys. The figures the runbook quotes are `flashdraft estimate`'s.
"""

import copy
import json
import re
import shlex
import subprocess
import uuid
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from tests.forked_cli import run_cli
from tests.servers import free_port_block, transformers_serve

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "qwen3.6-27b.yaml"
RUNBOOK = ROOT / "docs" / "reference-run.md"
TARGET_CONFIG = Path(__file__).parent / "assets" / "qwen3.6-27b-config.json"


def runbook_block(name: str) -> str:
    """The fenced block between the runbook's `<!-- name` and `<!-- /name -->` markers."""
    text = RUNBOOK.read_text()
    block = text[text.index(f"<!-- {name}") : text.index(f"<!-- /{name} -->")]
    return block.split("```", 2)[1].split("\n", 1)[1]


def runbook_estimate_command() -> list[str]:
    text = RUNBOOK.read_text()
    command = re.search(r"^flashdraft estimate .*?(?<!\\)$", text, re.M | re.S).group(0).replace("\\\n", " ")
    args = shlex.split(command)[1:]
    args[args.index("--target-config") + 1] = str(TARGET_CONFIG)  # the published shape, kept in the test assets
    return args


def test_every_figure_of_the_runbook_is_what_estimate_prints(cli, tmp_path):
    est_args = runbook_estimate_command()
    printed = cli(*est_args, check=True).stdout.splitlines()
    quoted = runbook_block("estimate").strip().splitlines()
    assert quoted and [line for line in quoted if line not in printed] == []
    est = json.loads(cli(*est_args, "--json", check=True).stdout)

    # The prose's figures, each from the same estimate (or the example changed as the prose says).
    prose = " ".join(RUNBOOK.read_text().split())  # as read, not as wrapped
    assert round(est["generation_hours"]) == 50 and round(est["generation_hours_at_mean"]) == 18
    assert est["completion_share_cut_max"] == 0 and est["longest_sample_tokens"] <= 3072
    assert est["train_steps"] == 112_500 and round(est["train_hours"], -1) == 100 and est["train_processes"] == 2
    assert round(est["checkpoint_bytes"] / 1e9) == 22 and est["checkpoints_kept"] == 3
    assert "1,200 steps, about an hour" in prose and 0.9 < 1200 * est["train_step_s"] / 3600 < 1.2
    assert f"would be {est['offline_features_bytes'] / 1e12:.0f} TB" in prose

    def with_train(**changes) -> dict:
        cfg = yaml.safe_load(EXAMPLE.read_text())
        for key, value in changes.items():
            section, name = key.split(".")
            cfg[section][name] = value
        path = tmp_path / f"example-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return json.loads(cli("estimate", str(path), *est_args[2:], "--json", check=True).stdout)

    assert "cut up to 65 %" in prose and with_train(**{"generate.max_new_tokens": 8192})["completion_share_cut_max"] \
        == pytest.approx(0.65, abs=0.005)
    assert "held-out eval (50 prompts × 512 tokens) is ≈ 0.71 hours" in prose and est["eval_hours"] == 0.71
    assert "on transformers' reference loop about 170 hours" in prose and round(est["train_hours_reference_loop"],
                                                                                -1) == 170
    two_nodes = with_train(**{"train.nnodes": 2, "train.rdzv_endpoint": "node0:29400"})
    assert "it is 56,250 steps, about 50 hours" in prose and two_nodes["train_steps"] == 56_250
    assert round(two_nodes["train_hours"], -1) == 50
    eighty = with_train(**{"train.micro_batch": 3})
    assert "at most 1.5× the step (about 150 hours on fast kernels)" in prose
    assert round(eighty["train_hours"], -1) == 150 and eighty["train_passes_per_step"] == 2
    six = with_train(**{"train.epochs": 6})
    assert "6 epochs would take about 600 hours" in prose and round(six["train_hours"], -2) == 600
    assert six["train_fits"]["max_steps"] < six["train_steps"]  # and the budget line says what would fit


def test_the_runbooks_seven_servers_are_the_examples_base_urls():
    loop = runbook_block("servers")
    gpus = re.findall(r"^for gpu in ([\d ]+); do", loop, re.M)
    ports = re.findall(r"--port \$\(\((\d+) \+ gpu\)\)", loop)
    assert len(gpus) == len(ports) == 2 and len(set(gpus)) == 1 and len(set(ports)) == 1
    assert "CUDA_VISIBLE_DEVICES=$gpu" in loop
    expected = [f"http://gen-0:{int(ports[0]) + int(gpu)}/v1" for gpu in gpus[0].split()]
    assert yaml.safe_load(EXAMPLE.read_text())["generate"]["base_urls"] == expected and len(expected) == 7


def stand_in(example: dict, workdir: Path, *, model: str, prompts: Path, store: str, base_urls: list[str]) -> dict:
    """The example as a machine here runs it. Replaced: the model (a tiny random-weight Llama with the embedded
    target's tokenizer: a real architecture, seconds a stage; no thinking mode), the sizes, the paths and the store;
    each `cuda:N` device entry becomes `cpu`. Kept: the backend, one generate
    process for every server, `train.nproc_per_node` with its per-process device entries, the stages' layout."""
    cfg = copy.deepcopy(example)
    cfg.update(workdir=str(workdir), store=store)
    cfg["generate"].update(prompts=str(prompts), model=model, base_urls=base_urls, thinking=False,
                           max_new_tokens=24, batch_size=4, concurrency=6)
    cfg["tokenize"].update(tokenizer=model, max_length=256, block_size=4, min_loss_fraction=0.0, workers=1)
    train = cfg["train"]
    train.pop("epochs")
    train.update(target=model, num_layers=1, block_size=4, max_anchors=4, batch_size=1, micro_batch=1, max_steps=8,
                 checkpoint_every=2, keep_checkpoints=2, eval_samples=2, lr=3e-3, max_length=256)
    for key in ("device", "target_device"):
        train[key] = re.sub(r"cuda:\d+", "cpu", train[key])
    cfg["eval"].update(target=model, prompts=str(prompts), max_prompts=2, max_new_tokens=12)
    return cfg


@pytest.mark.slow
def test_the_seeds_topology_runs_the_runbook_end_to_end(tmp_path, s3env, tiny_model_dir):
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["train"]["nproc_per_node"] == 2 and example["generate"]["backend"] == "openai"
    store = f"s3://flashdraft/reference-{uuid.uuid4().hex[:8]}"
    prompts = tmp_path / "prompts.jsonl"
    topics = ["rivers", "bread", "chess", "owls", "bridges", "tea", "kites", "bees", "maps"]
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me two facts about {t}."}) + "\n" for t in topics))
    timeline: list[str] = []

    def machine(name: str, base_urls: list[str] | None = None) -> Path:
        workdir = tmp_path / name
        workdir.mkdir()
        config = workdir / "qwen3.6-27b.yaml"
        config.write_text(yaml.safe_dump(stand_in(example, workdir / "work", model=tiny_model_dir, prompts=prompts,
                                                  store=store, base_urls=base_urls or [])))
        return config

    def run(name: str, *args: str) -> subprocess.CompletedProcess:
        proc = run_cli(*args, timeout=900)
        timeline.append(f"{name}: flashdraft {' '.join(Path(a).name if '/' in a else a for a in args)} "
                        f"→ exit {proc.returncode}")
        assert proc.returncode == 0, "\n".join(timeline) + f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    # gen-0: the runbook's loop, three servers on consecutive ports (standing in for seven).
    ports = free_port_block(3)
    logs = [tmp_path / f"serve-{i}.log" for i in range(3)]
    with ExitStack() as servers:
        urls = [servers.enter_context(transformers_serve(tiny_model_dir, log, port=port)) + "/v1"
                for port, log in zip(ports, logs, strict=True)]
        cpu_box = machine("cpu-box", urls)
        run("cpu-box", "run", str(cpu_box), "--until", "tokenize")
    assert all("/v1/chat/completions" in log.read_text() for log in logs), "every server took requests"
    generated = json.loads((tmp_path / "cpu-box" / "work" / "generate" / "manifest.json").read_text())["stats"]
    assert generated["records"] == len(topics)

    # The training node: an empty disk and the runbook's one command.
    node = machine("train-node")
    trained = run("train-node", "run", str(node), "--from", "train")
    said = trained.stdout + trained.stderr
    assert "starting 2 processes" in said and "2 process(es)" in said, said
    assert re.search(r"^pull: \S+/dataset — downloaded", said, re.M), said
    work = tmp_path / "train-node" / "work"
    assert (work / "train" / "drafter" / "manifest.json").is_file() and (work / "eval" / "report.json").is_file()

    # Anyone: every stage verified in the store, checkpoints included.
    status = run("status-host", "status", "--config", str(machine("status-host")), "--store", store, "--json")
    rows = json.loads(status.stdout.strip().splitlines()[-1])["stages"]
    in_store = {r["stage"]: r["verified"] for r in rows if r["where"] == "store"}
    assert in_store == {"generate": True, "tokenize": True, "train": True, "eval": True}, "\n".join(timeline)
    client = s3env.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="flashdraft", Prefix=store.split("/", 3)[3] + "/train/"
                                                     "checkpoints/").get("Contents", [])]
    assert len({k.split("/")[3] for k in keys if k.endswith("manifest.json")}) == 2  # keep_checkpoints in the store
    print("\n" + "\n".join(timeline))
