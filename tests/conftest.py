"""Shared fixtures: the offline tiny tokenizer/model, built once per test session."""
import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (8 logical CPUs: actors ask for fractions)."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


TOOL_PROMPT_USER = "What is 12 * 34?"
TOOL_TRAJECTORIES = [
    "<think> compute </think> <python>print(12 * 34)</python>",
    "<think> look up </think> <search>Vrorkmere founder</search>",
]


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """The tiny model over-fitted for a few seconds so that, after the chat prompt of
    TOOL_PROMPT_USER, sampling writes `<python>`/`<search>` calls and then an answer: rollouts
    with it exercise real tools, results and continuation."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    prompt = tok.apply_chat_template([{"role": "user", "content": TOOL_PROMPT_USER}], add_generation_prompt=True,
                                     tokenize=False)
    texts = [prompt + t for t in TOOL_TRAJECTORIES]
    texts.append(prompt + TOOL_TRAJECTORIES[0] + " <result>\n408\n</result> <answer> \\boxed{408} </answer>")
    batch = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    width = max(map(len, batch))
    ids = torch.tensor([b + [tok.pad_token_id] * (width - len(b)) for b in batch])
    mask = torch.tensor([[1] * len(b) + [0] * (width - len(b)) for b in batch])
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(60):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
