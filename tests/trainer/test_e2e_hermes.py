"""End to end in the hermes format (issue 49): 2 steps of ARPO on 2 Ray workers with the Python
tool and one MCP tool (a real stdio MCP server, tests/tools/fixtures/mcp_calc_server.py), the
tiny model over-fitted to write `<tool_call>` JSON for those functions.

Checked from the rollout dumps, independently of the trainer: the loss mask is 1 exactly on the
assistant turns (the tokens between each generation prompt and its `<|im_end|>`) and 0 on the tool
messages; branches share their parent's tokens up to a tool-message boundary; the reward is 1
exactly when the *final* assistant turn holds \\boxed{408}."""
import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "tests" / "tools" / "fixtures" / "mcp_calc_server.py"
TOOL_OVERRIDES = [
    "~actor_rollout_ref.rollout.tools.tool_instances.search",
    "+actor_rollout_ref.rollout.tools.tool_instances.calc.class_path=verl_arpo.workers.rollout.tools.mcp_tool.MCPTool",
    f"+actor_rollout_ref.rollout.tools.tool_instances.calc.params.command=[{sys.executable},{SERVER}]",
    "+actor_rollout_ref.rollout.tools.tool_instances.calc.params.name=calc",
    "+actor_rollout_ref.rollout.tools.tool_instances.calc.params.tools=[add]",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
]


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="cpu_tiny", overrides=overrides)


@pytest.fixture(scope="module")
def hermes_model(tiny_model_dir, tmp_path_factory):
    """The tiny model over-fitted on the prompt rendered with the run's own function schemas."""
    from verl_arpo.trainer.config import validate_config
    from verl_arpo.utils.tiny_model import make_tool_model
    from verl_arpo.workers.rollout.tools.registry import tool_schemas

    cfg = validate_config(_compose([f"actor_rollout_ref.model.path={tiny_model_dir}", *TOOL_OVERRIDES]))
    schemas = tool_schemas(cfg.actor_rollout_ref.rollout.tools)
    assert [s["function"]["name"] for s in schemas] == ["python", "add"]
    return make_tool_model(tiny_model_dir, tmp_path_factory.mktemp("hermes_model"), tools=schemas), schemas


def _expected_mask(ids: list[int], eos: int, gen_prompt: list[int]) -> list[int]:
    """1 on the assistant turns (from the start, or after a generation prompt, to the EOS
    inclusive), 0 on what the template wrote between them (up to the next generation prompt)."""
    want, in_turn, k = [], True, 0
    while k < len(ids):
        if in_turn:
            want.append(1)
            in_turn = ids[k] != eos
            k += 1
        elif ids[k:k + len(gen_prompt)] == gen_prompt:
            want += [0] * len(gen_prompt)
            k, in_turn = k + len(gen_prompt), True
        else:
            want.append(0)
            k += 1
    return want


def test_two_arpo_steps_in_the_hermes_format_with_an_mcp_tool(ray_local, hermes_model, tmp_path):
    from transformers import AutoTokenizer

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo
    from verl_arpo.utils.rollout_dump import read_dump

    model_dir, schemas = hermes_model
    rows = [{"data_source": "arpo_toy_math", "prompt": [{"role": "user", "content": "What is 12 * 34?"}],
             "ability": "math", "reward_model": {"ground_truth": "408", "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "run"
    cfg = validate_config(_compose([
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/train.parquet", f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]",
        f"trainer.rollout_data_dir={out}/rollout", "trainer.total_training_steps=2", "data.train_batch_size=2",
        "data.max_prompt_length=640", "data.max_response_length=192", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.initial_rollouts=2", "actor_rollout_ref.rollout.branch_probability=1.0",
        "actor_rollout_ref.rollout.tools.call_limit=2", "actor_rollout_ref.rollout.seed=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", *TOOL_OVERRIDES]))
    _, trainer = run_ppo(cfg, keep_workers=True)
    try:   # one more rollout, read as tensors: the ids the workers train on
        batch, _ = trainer._rollout(trainer._collate(trainer.train_dataset, [0, 1]), step=99)
    finally:
        trainer.shutdown()
    lines = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert sum(m["tools/calls"] for m in steps) > 0
    # reported every step; not asserted 0: a sampled token sequence that the tokenizer would merge
    # otherwise (non-canonical BPE) differs from a full render, which is what the check is for
    assert all(0.0 <= m["rollout/tokenization_mismatch"] <= 1.0 for m in steps)

    tok = AutoTokenizer.from_pretrained(model_dir)
    gen_prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    b, nt = batch.batch, batch.non_tensor_batch
    rows = []
    for i in range(len(batch)):
        L = int(b["attention_mask"][i, -b["responses"].shape[-1]:].sum())
        ids, mask = b["responses"][i, :L].tolist(), b["response_mask"][i, :L].tolist()
        assert mask == _expected_mask(ids, tok.eos_token_id, gen_prompt), nt["traj_id"][i]
        rows.append(ids)
    assert any(nt["parent_id"]), "ARPO with branch_probability 1 branched nowhere"
    traj = list(zip(nt["uid"], nt["traj_id"]))   # trajectory ids are per prompt (and per rank): key by uid too
    for i, parent in enumerate(nt["parent_id"]):
        if parent:
            j, pos = traj.index((nt["uid"][i], parent)), int(nt["branch_pos"][i])
            assert rows[i][:pos] == rows[j][:pos] and rows[i][pos - len(gen_prompt):pos] == gen_prompt

    records = [r for s in (1, 2) for r in read_dump(out / "rollout" / f"rollout_{s}.jsonl")]
    names = {c["name"] for r in records for c in r["tool_calls"]}
    assert names & {"python", "add"}, names
    for r in records:   # the reward reads the final assistant turn only
        final = r["response"].rsplit("<|im_start|>assistant\n", 1)[-1]
        assert r["reward"] == (1.0 if "\\boxed{408}" in final else 0.0), (r["traj_id"], final)
        for c in r["tool_calls"]:
            if c["name"] == "add" and c["ok"]:
                assert c["result"].strip() == str(c["arguments"]["a"] + c["arguments"]["b"])
