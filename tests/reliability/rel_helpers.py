"""Shared pieces of the reliability suite: hypothesis settings, a stop-string-faithful scripted
engine, prompt batches, the rollout invariants, a scriptable fake search API and an RSS probe.

`FuzzEngine` differs from tests/rollout/scripted.py's `ScriptedEngine` on purpose: fuzzed text is
fed token by token through the *real* engine rules (stop at EOS, at the first stop string in the
decoded text of this call — checked with the HF engine's own `StopChecker` — or at the request's
budget), so text that a test cannot predict (nested, repeated, split tags, special tokens) still
produces exactly what a real engine would hand the loop.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import torch
from hypothesis import HealthCheck, settings

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.workers.rollout.engines.base import GenOutput, InferenceEngine
from verl_arpo.workers.rollout.engines.hf_requests import StopChecker
from verl_arpo.workers.rollout.tool_text import encode_tool_result

# RELIABILITY_FUZZ_SCALE=10 runs ten times more examples (a deeper local run); the default keeps
# the suite fast and, with derandomize, the same examples every run.
SCALE = max(1, int(os.environ.get("RELIABILITY_FUZZ_SCALE", "1")))


def fuzz(max_examples: int):
    return settings(max_examples=max_examples * SCALE, deadline=None, derandomize=SCALE == 1, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
                    print_blob=True)


# ------------------------------------------------------------------------------------------ engine
@dataclass
class FuzzTurn:
    text: str
    split_special: bool = False
    """True: special-token *text* in `text` becomes ordinary tokens (the model spelled it out);
    False: it becomes the special id (the model sampled the special token)."""


@dataclass
class FuzzEngine(InferenceEngine):
    """`script(request, round_k) -> FuzzTurn | str`; round_k counts this trajectory's rounds
    (a branch continues its parent's count). Log-prob of every token: -0.5."""

    tokenizer: object
    script: Callable
    rounds: dict = field(default_factory=dict)
    emitted: dict = field(default_factory=dict)  # request id -> list of (round token ids)

    def __post_init__(self):
        self.eos_token_ids = [self.tokenizer.eos_token_id]

    def _encode(self, turn: FuzzTurn) -> list[int]:
        try:
            return self.tokenizer.encode(turn.text, add_special_tokens=False, split_special_tokens=turn.split_special)
        except TypeError:
            return self.tokenizer.encode(turn.text, add_special_tokens=False)

    def generate(self, requests):
        outs, before = [], dict(self.rounds)
        for r in requests:
            k = before.get(r.request_id, before.get(r.parent_id, 0) if r.parent_id else 0)
            self.rounds[r.request_id] = k + 1
            turn = self.script(r, k)
            turn = FuzzTurn(turn) if isinstance(turn, str) else turn
            planned = self._encode(turn) + [self.tokenizer.eos_token_id]  # the model ends with EOS
            checker = StopChecker(self.tokenizer, r.stop)
            ids, finish, stop_str = [], "length", None
            for tok in planned:
                if len(ids) >= r.max_new_tokens:
                    break
                ids.append(tok)
                if tok in self.eos_token_ids:
                    finish = "eos"
                    break
                s = checker.check(ids)
                if s is not None:
                    finish, stop_str = "stop", s
                    break
            self.emitted.setdefault(r.request_id, []).append(list(ids))
            outs.append(GenOutput(token_ids=ids, finish_reason=finish, stop_str=stop_str,
                                  logprobs=[-0.5] * len(ids), topk_logprobs=[[-0.1, -2.5]] * len(ids),
                                  entropy=[1.0] * len(ids)))
        return outs

    def update_weights(self, named_tensors):
        pass

    def release(self, request_ids=None):
        if request_ids is None:
            self.rounds.clear()


def prompts(tok, texts, step=0) -> DataProto:
    """Left-padded prompt batch with one uid per prompt."""
    enc = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               non_tensors={"uid": as_object_array([f"u{i}" for i in range(len(texts))])},
                               meta_info={"global_steps": step})


# ------------------------------------------------------------------------------------------ invariants
def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of zeros."""
    out, start = [], None
    for i, m in enumerate(mask + [1]):
        if m == 0 and start is None:
            start = i
        elif m != 0 and start is not None:
            out.append((start, i))
            start = None
    return out


def check_rollout(out: DataProto, tok, n: int, num_prompts: int, response_length: int, call_limit: int,
                  forbidden_content: str | None = None) -> None:
    """The invariants every rollout must keep, whatever the model wrote and the tools returned."""
    R = response_length
    b, nt = out.batch, out.non_tensor_batch
    assert len(out) == n * num_prompts
    assert list(nt["uid"]) == [f"u{i}" for i in range(num_prompts) for _ in range(n)]
    special = set(tok.all_special_ids)
    eos = tok.eos_token_id
    assert b["responses"].shape[-1] == R
    resp_attn = b["attention_mask"][:, -R:]
    for k in range(len(out)):
        L = int(resp_attn[k].sum())
        attn, mask = resp_attn[k].tolist(), b["response_mask"][k].tolist()
        lp, resp = b["rollout_log_probs"][k].tolist(), b["responses"][k].tolist()
        assert attn == [1] * L + [0] * (R - L), "response attention is not one left-aligned block"
        assert all(m <= a for m, a in zip(mask, attn)), "loss mask outside the attention mask"
        assert all(v == 0.0 for v, m in zip(lp, mask) if m == 0), "log-prob where the mask is 0"
        assert all(v == -0.5 for v, m in zip(lp, mask) if m == 1), "sampled token lost its log-prob"
        calls = list(nt["tool_calls"][k])
        assert len(calls) == nt["num_tool_calls"][k] <= call_limit
        finish = nt["finish_reason"][k]
        runs = _runs(mask[:L])
        if finish == "call_limit":  # the forced EOS is the last token, alone, masked
            assert runs and runs[-1] == (L - 1, L) and resp[L - 1] == eos
            runs = runs[:-1]
        # every zero run is exactly one tool result block (the last may be cut by the budget)
        assert len(runs) == len(calls), (runs, calls)
        for (s, e), call in zip(runs, calls):
            expected = encode_tool_result(tok, call["result"])
            assert resp[s:e] == expected[: e - s], "a result block is not the tool's encoded text"
            if e - s < len(expected):
                assert e == L and finish == "length"
            assert not special.intersection(resp[s:e]), "special-token id inside a tool result"
            if forbidden_content is not None:
                assert forbidden_content not in call["content"], "tool got text from the prompt"


# ------------------------------------------------------------------------------------------ search API
class FakeSearchAPI:
    """A real HTTP server on 127.0.0.1 standing in for Bright Data's request API.

    `responder(request_number, headers, body) -> (status, body, headers)` decides every answer;
    each request's arrival time and Authorization header are recorded."""

    def __init__(self, responder: Callable | None = None, port: int = 0):
        self.responder = responder or (lambda i, h, b: (200, {"organic": [{"description": "ok"}]}, {}))
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with api._lock:
                    i = len(api.requests)
                    api.requests.append({"t": time.monotonic(), "headers": dict(self.headers), "body": raw})
                status, body, headers = api.responder(i, dict(self.headers), raw)
                if not isinstance(body, (bytes, str)):
                    body = json.dumps(body)
                body = body.encode() if isinstance(body, str) else body
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/request"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------ memory
def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def write_tool_task(folder, rows: int, valid_rows: int = 0):
    """`rows` copies of the tool model's arithmetic prompt as train.parquet (and the first
    `valid_rows` as valid.parquet) in `folder`; returns the folder."""
    import pandas as pd

    from verl_arpo.utils.tiny_model import TOOL_PROMPT_USER

    data = [{"data_source": "arpo_toy_math", "prompt": [{"role": "user", "content": TOOL_PROMPT_USER}],
             "ability": "math", "reward_model": {"ground_truth": "408", "style": "rule"},
             "extra_info": {"index": i}} for i in range(rows)]
    pd.DataFrame(data).to_parquet(folder / "train.parquet")
    if valid_rows:
        pd.DataFrame(data[:valid_rows]).to_parquet(folder / "valid.parquet")
    return folder
