"""RLHFDataset: prompts from one or several parquet files, tokenised with the chat template.

`RLHFDataset(data_files, tokenizer, config)` (verl's name and arguments). `config` is the typed `data`
section (`config.DataConfig`; None = its defaults, which are the YAML's, docs/configuration.md):
- `prompt_key`: the column holding the prompt;
- `max_prompt_length`: prompts are left-padded to this many tokens;
- `truncation`: for a longer prompt, "error" raises (naming the file and row), "left" keeps its
  last `max_prompt_length` tokens, "right" its first;
- `filter_overlong_prompts`: drop longer prompts at load time (counted and logged);
- `return_raw_chat`: also return the chat messages as `raw_prompt`;
- `system_prompt_override`: replace (or insert) the system message of every prompt;
- `apply_chat_template_kwargs`, `custom_chat_template`: passed to the chat template.

Loading: rows are normalised by `schema.normalize_row` (verl schema and the flat docs schema, see
there). A malformed row is skipped and counted, with a warning naming file, row number and field
(the first 20 per file; then one summary line). The backspace defect of the reference's system
prompt (U+0008 + "oxed" for "\\boxed") is repaired in every message and counted. A dataset left
with no rows raises ValueError naming the file(s). `dataset.stats` holds rows_read, rows_skipped,
overlong_dropped, backspace_repairs and rows (kept); `dataset.skipped` lists (file, row, field,
reason).

Item i: `input_ids`, `attention_mask`, `position_ids` (1-D, length max_prompt_length; position =
cumsum(mask) - 1, clamped at 0), `raw_prompt_ids` (the unpadded, possibly truncated ids),
`raw_prompt` (messages), `data_source`, `ability`, `reward_model`, `ground_truth`, `extra_info`,
`index` (= extra_info["index"] if present, else the row's position in the dataset).
`collate_fn` stacks tensors and turns everything else into 1-D object arrays: its output goes
straight into `DataProto.from_single_dict`.

Departures from verl: `return_raw_chat` defaults to True (the tool rollout needs the messages);
malformed rows are skipped with a report instead of crashing the run mid-epoch; the flat schema is
accepted. Not covered: multimodal processors (`processor` must be None), verl's "middle"
truncation, HF `datasets` caching.
"""
from __future__ import annotations

import logging
import os
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from verl_arpo.utils.chat_template import configure_chat_template, render_chat
from verl_arpo.config import DataConfig
from verl_arpo.utils.resources import resolve_bundled

from .schema import apply_system_prompt, normalize_row, repair_backspace

__all__ = ["RLHFDataset", "collate_fn"]

logger = logging.getLogger(__name__)
MAX_WARNINGS_PER_FILE = 20
TRUNCATION_MODES = ("error", "left", "right")


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors; put every other field into a 1-D numpy object array (one entry per item)."""
    if not items:
        raise ValueError("collate_fn: empty batch")
    out: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        out[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else _object_array(values)
    return out


def _records(table) -> tuple[list[dict[str, Any]], dict[int, tuple]]:
    """(row dicts, {row: (field, reason)} for rows holding a string cell that is not UTF-8).

    [reliability: tests/reliability/README.md] parquet files written by other tools can hold bytes that are not UTF-8
    in a *string* column; `to_pylist` then raised UnicodeDecodeError and the whole file was
    rejected without naming the row. Here only the bad cells' rows are reported (and skipped)."""
    try:
        return table.to_pylist(), {}
    except UnicodeDecodeError:
        pass
    columns, bad = {}, {}
    for name in table.column_names:
        col = table.column(name)
        try:
            columns[name] = col.to_pylist()
            continue
        except UnicodeDecodeError:
            pass
        values = []
        for i in range(len(col)):
            try:
                values.append(col[i].as_py())
            except UnicodeDecodeError as exc:
                values.append(None)
                bad.setdefault(i, (name, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
        columns[name] = values
    return [{name: columns[name][i] for name in table.column_names} for i in range(table.num_rows)], bad


class RLHFDataset(Dataset):
    """Prompts for RL from parquet files (see the module docstring)."""

    def __init__(self, data_files: Any, tokenizer: Any, config: DataConfig | None = None, processor: Any = None,
                 tools: list[dict] | None = None):
        """tools: the function schemas the prompts are rendered with (`multi_turn.format=hermes`:
        `apply_chat_template(..., tools=tools)`); the rows then keep `raw_prompt` too, which the
        rollout's tokenization sanity check renders again."""
        if processor is not None:
            raise NotImplementedError("multimodal processors are not supported by RLHFDataset")
        if isinstance(data_files, (str, os.PathLike)):
            data_files = [data_files]
        self.data_files = [str(resolve_bundled(f)) for f in data_files]  # the cwd, then the bundled task
        if not self.data_files:
            raise ValueError("RLHFDataset: data_files is empty")
        if config is None:
            config = DataConfig()
        if not isinstance(config, DataConfig):
            raise TypeError(f"RLHFDataset: config is the typed data section (config.DataConfig), got "
                            f"{type(config).__name__}; build it with validate_config(cfg).data")
        self.tokenizer = tokenizer
        self.prompt_key = config.prompt_key
        self.max_prompt_length = int(config.max_prompt_length)
        self.truncation = config.truncation
        self.filter_overlong_prompts = bool(config.filter_overlong_prompts)
        self.tools = list(tools) if tools else None
        self.return_raw_chat = bool(config.return_raw_chat) or self.tools is not None
        self.system_prompt_override = config.system_prompt_override
        self.chat_template_kwargs = dict(config.apply_chat_template_kwargs or {})
        configure_chat_template(tokenizer, config.custom_chat_template)
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length must be positive, got {self.max_prompt_length}")
        self.stats: dict[str, int] = {"rows_read": 0, "rows_skipped": 0, "overlong_dropped": 0,
                                      "backspace_repairs": 0, "rows": 0}
        self.skipped: list[tuple] = []
        self.rows: list[dict[str, Any]] = []
        self._token_ids: list[list[int]] | None = None
        for path in self.data_files:
            self._load_file(path)
        if not self.rows:
            raise ValueError(f"RLHFDataset: no valid rows in {self.data_files} "
                             f"({self.stats['rows_read']} read, {self.stats['rows_skipped']} malformed)")
        if self.filter_overlong_prompts:
            self._filter_overlong()
        self.stats["rows"] = len(self.rows)

    # -- loading -------------------------------------------------------------------------------
    def _load_file(self, path: str) -> None:
        import pyarrow.parquet as pq

        if not os.path.isfile(path):
            raise FileNotFoundError(f"RLHFDataset: data file {path!r} does not exist")
        try:
            records, undecodable = _records(pq.read_table(path))
        except Exception as exc:
            raise ValueError(f"RLHFDataset: cannot read parquet file {path!r}: {exc}") from exc
        skipped_here, repairs_here = 0, 0
        for row_number, raw in enumerate(records):
            self.stats["rows_read"] += 1
            if row_number in undecodable:
                row, error = None, undecodable[row_number]
            else:
                row, error = normalize_row(raw, self.prompt_key)
            if error is not None:
                skipped_here += 1
                self.skipped.append((path, row_number, error[0], error[1]))
                if skipped_here <= MAX_WARNINGS_PER_FILE:
                    logger.warning("RLHFDataset: skipping %s row %d: field %r %s", path, row_number, *error)
                continue
            if self.system_prompt_override:
                row["messages"] = apply_system_prompt(row["messages"], self.system_prompt_override)
            for msg in row["messages"]:
                msg["content"], count = repair_backspace(msg["content"])
                repairs_here += count
            row["source_file"], row["row_number"] = path, row_number
            self.rows.append(row)
        self.stats["rows_skipped"] += skipped_here
        self.stats["backspace_repairs"] += repairs_here
        if skipped_here > MAX_WARNINGS_PER_FILE:
            logger.warning("RLHFDataset: %s: %d malformed rows skipped in total (first %d shown)",
                           path, skipped_here, MAX_WARNINGS_PER_FILE)
        if repairs_here:
            logger.info("RLHFDataset: %s: repaired %d backspace defects (U+0008 'oxed' -> '\\boxed')",
                        path, repairs_here)

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = render_chat(self.tokenizer, messages, True, self.chat_template_kwargs, tools=self.tools)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _filter_overlong(self) -> None:
        ids = [self._encode(row["messages"]) for row in self.rows]
        keep = [i for i, x in enumerate(ids) if len(x) <= self.max_prompt_length]
        dropped = len(self.rows) - len(keep)
        if dropped:
            examples = [(self.rows[i]["source_file"], self.rows[i]["row_number"], len(ids[i]))
                        for i in range(len(self.rows)) if len(ids[i]) > self.max_prompt_length][:5]
            logger.warning("RLHFDataset: dropped %d of %d prompts longer than max_prompt_length=%d "
                           "tokens (file, row, tokens), first ones: %s",
                           dropped, len(self.rows), self.max_prompt_length, examples)
        self.stats["overlong_dropped"] = dropped
        self.rows = [self.rows[i] for i in keep]
        self._token_ids = [ids[i] for i in keep]
        if not self.rows:
            raise ValueError(f"RLHFDataset: every prompt in {self.data_files} is longer than "
                             f"max_prompt_length={self.max_prompt_length} tokens")

    # -- items ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str, key: str = "column") -> list[Any]:
        """Every kept row's value of `name` (e.g. `data_source`); `key` names the config key that
        asked for it in the error raised when a row lacks the column."""
        missing = [i for i, row in enumerate(self.rows) if name not in row]
        if missing:
            row = self.rows[missing[0]]
            raise ValueError(f"{key}={name!r}: {len(missing)} rows have no such column (first: "
                             f"{row['source_file']} row {row['row_number']}; columns: "
                             f"{sorted(k for k in row if not k.startswith('_'))}); name a column of the data")
        return [row[name] for row in self.rows]

    def _truncate(self, ids: list[int], row: dict[str, Any]) -> list[int]:
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        raise ValueError(
            f"prompt of {row['source_file']} row {row['row_number']} has {len(ids)} tokens > "
            f"max_prompt_length={limit}; set data.truncation=left|right or data.filter_overlong_prompts=True"
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        ids = self._token_ids[index] if self._token_ids is not None else self._encode(row["messages"])
        ids = self._truncate(ids, row)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        n_pad = self.max_prompt_length - len(ids)
        input_ids = torch.tensor([pad] * n_pad + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * n_pad + [1] * len(ids), dtype=torch.long)
        position_ids = torch.clamp(torch.cumsum(attention_mask, dim=0) - 1, min=0)
        extra_info = row["extra_info"]
        item = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "raw_prompt_ids": list(ids),
            "data_source": row["data_source"],
            "ability": row["ability"],
            "reward_model": row["reward_model"],
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": extra_info,
            "index": extra_info.get("index", index),
        }
        if self.return_raw_chat:
            item["raw_prompt"] = [dict(m) for m in row["messages"]]
        return item
