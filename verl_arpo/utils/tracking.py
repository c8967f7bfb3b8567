"""Experiment tracking: one `Tracking` object fans each step's metrics out to the chosen backends.

    tracker = Tracking("verl_arpo", "run1", ["console", "jsonl"], config=cfg, log_dir="ckpt/run1/logs")
    tracker.set_total(100)                  # enables the ETA and the progress bar
    tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": -0.01}, step=1)
    tracker.finish()

Backends (`trainer.logger`):
    console      one compact line per step with the key metrics (score, pg_loss, response length,
                 tool calls, step time, ETA); a `rich` progress bar on a terminal once a total is known
    jsonl        `<log_dir>/metrics.jsonl`, one JSON object {"step": s, **metrics} per log call, and the
                 masked config in `<log_dir>/config.json`
    tensorboard  `<log_dir>/tensorboard/` event files (numeric metrics as scalars, config as text)
    wandb        a run under `<log_dir>/wandb/`; `WANDB_MODE=offline` works as usual. Code, git and
                 host metadata (which includes the command line, where keys may be passed) are not
                 collected.

Every config handed to a backend goes through `mask_secrets` first, whoever built it.

Validation generations (`trainer.log_val_generations`, utils/val_generations.py):
`tracker.log_generations(samples, step)` prints a block on the console, appends one line to
`<log_dir>/val_generations.jsonl`, writes a text summary `val/generations` to tensorboard, and logs
a wandb table `val/generations` with one row per validation (step, input_i, output_i, score_i), as verl.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Mapping, Sequence

from omegaconf import ListConfig

from verl_arpo.utils.secrets import mask_secrets, mask_text

__all__ = ["Tracking", "ConsoleBackend", "JsonlBackend", "TensorboardBackend", "WandbBackend", "CONSOLE_KEYS",
           "LOGGER_BACKENDS", "parse_logger", "training_steps"]

LOGGER_BACKENDS = ("console", "wandb", "tensorboard", "jsonl")


def parse_logger(value: Any) -> list[str]:
    """trainer.logger as a list: accepts a list, "console", "console,wandb" or "[console, wandb]"."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v).strip() for v in value]
    text = str(value).strip().strip("[]")
    return [part.strip().strip("'\"") for part in text.split(",") if part.strip().strip("'\"")]



CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("critic/score/mean", "score"),
    ("val/score/mean", "val_score"),
    ("actor/pg_loss", "pg_loss"),
    ("response_length/mean", "resp_len"),
    ("tools/calls_per_traj", "tool_calls"),
    ("timing_s/step", "step_s"),
)
"""(metric, label) pairs shown on the console line, in this order, when present."""


def _scalar(value: Any) -> Any:
    """numpy / torch scalars → Python numbers; other non-JSON values → str."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # not a single element
            return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Number):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _scalar(v) for k, v in value.items()}
    return str(value)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ConsoleBackend:
    """One line per step, plus a rich progress bar with ETA on a terminal when the total is known."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.total: int | None = None
        self._t0: float | None = None
        self._step0: int | None = None
        self._progress = None
        self._task = None

    def set_total(self, total: int | None) -> None:
        self.total = int(total) if total else None

    def eta(self, step: int, now: float | None = None) -> timedelta | None:
        """Remaining time from the mean wall time per step since the first logged step."""
        now = time.monotonic() if now is None else now
        if self._t0 is None or not self.total or step <= (self._step0 or 0):
            return None
        per_step = (now - self._t0) / (step - self._step0)
        return timedelta(seconds=round(per_step * max(0, self.total - step)))

    def format_line(self, data: Mapping[str, Any], step: int, eta: timedelta | None = None) -> str:
        """`step 3/10 | score 0.5 | pg_loss -0.0123 | resp_len 812.3 | tool_calls 2.1 | step_s 45.2 | eta 0:05:16`."""
        parts = [f"step {step}/{self.total}" if self.total else f"step {step}"]
        parts += [f"{label} {_fmt(_scalar(data[key]))}" for key, label in CONSOLE_KEYS if key in data]
        if eta is not None:
            parts.append(f"eta {eta}")
        return " | ".join(parts)

    def _bar(self):
        if self._progress is None and self.total:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            console = Console(file=self.stream)
            if not console.is_terminal:
                return None
            self._progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      TextColumn("eta"), TimeRemainingColumn(), console=console)
            self._task = self._progress.add_task("train", total=self.total)
            self._progress.start()
        return self._progress

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if self._t0 is None:
            self._t0, self._step0 = time.monotonic(), step
        line = self.format_line(data, step, self.eta(step))
        bar = self._bar()
        if bar is not None:
            bar.update(self._task, completed=min(step, self.total or step))
            bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def log_generations(self, samples: list[dict], step: int) -> None:
        from verl_arpo.utils.val_generations import format_block

        bar = self._progress
        if bar is not None:
            bar.console.print(format_block(samples, step), markup=False, highlight=False)
        else:
            print(format_block(samples, step), file=self.stream, flush=True)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class JsonlBackend:
    """`<log_dir>/metrics.jsonl` (appended: a resumed run continues the file) and `config.json`."""

    def __init__(self, log_dir: Path, config: Mapping[str, Any] | None):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        if config is not None:
            (log_dir / "config.json").write_text(json.dumps(_scalar(config), indent=2), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, data: Mapping[str, Any], step: int) -> None:
        record = {"step": step, **{str(k): _scalar(v) for k, v in data.items()}}
        self._file.write(mask_text(json.dumps(record)) + "\n")
        self._file.flush()

    def log_generations(self, samples: list[dict], step: int) -> None:
        with open(self.path.parent / "val_generations.jsonl", "a", encoding="utf-8") as f:
            f.write(mask_text(json.dumps({"step": step, "samples": samples}, ensure_ascii=False)) + "\n")

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


def training_steps(metrics_file: Path, key: str = "critic/score/mean") -> list[dict]:
    """JsonlBackend's metrics.jsonl read back: one row per training step, in step order. A resumed run appends
    to the file, so the last line of a step counts; a line without `key` (not a training step's) is skipped."""
    rows: dict[int, dict] = {}
    for line in open(metrics_file, encoding="utf-8"):
        m = json.loads(line)
        if "step" in m and key in m:
            rows[int(m["step"])] = m
    return [rows[s] for s in sorted(rows)]


class TensorboardBackend:
    """Scalars in `<log_dir>/tensorboard/`; the masked config as a text summary at step 0."""

    def __init__(self, log_dir: Path, config: Mapping[str, Any] | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(_scalar(config), indent=2) + "\n```", 0)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for key, value in data.items():
            value = _scalar(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, samples: list[dict], step: int) -> None:
        from verl_arpo.utils.val_generations import format_block

        self.writer.add_text("val/generations", "```\n" + format_block(samples, step) + "\n```", step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def private_wandb_settings(settings_cls):
    """wandb settings that collect no code, git or host metadata (the host metadata records the
    command line, where keys may be passed). Fails closed: a wandb that cannot turn the metadata off
    is an error, never a run that uploads it."""
    try:
        return settings_cls(x_disable_meta=True, disable_code=True, disable_git=True, save_code=False, silent=True)
    except Exception:  # noqa: BLE001 - an older wandb without one of the optional fields
        pass
    try:
        return settings_cls(x_disable_meta=True, silent=True)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError("this wandb cannot turn off its host metadata (which records the command line, where "
                           "API keys may be passed): upgrade wandb, or use trainer.logger without wandb") from exc


class WandbBackend:
    """A wandb run with files under `<log_dir>/wandb/`; honours WANDB_MODE (offline, disabled)."""

    def __init__(self, project_name: str, experiment_name: str, log_dir: Path,
                 config: Mapping[str, Any] | None, run_id: str | None = None):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        settings = private_wandb_settings(wandb.Settings)
        # a resumed training run continues its wandb run: the id is stored in the checkpoint
        self.run = wandb.init(project=project_name, name=experiment_name, dir=str(log_dir), id=run_id,
                              resume="allow" if run_id else None,
                              config=_scalar(config) if config is not None else None, settings=settings)

    @property
    def run_id(self) -> str | None:
        return getattr(self.run, "id", None)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self.run.log({str(k): _scalar(v) for k, v in data.items()}, step=step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        """verl's table: one row per validation (a wandb table is immutable once logged, so the whole
        table so far is logged again)."""
        import wandb

        rows = getattr(self, "_generation_rows", [])
        rows.append([step] + [mask_text(str(v)) if k != "score" else v for s in samples
                              for k, v in (("input", s["input"]), ("output", s["output"]), ("score", s["score"]))])
        self._generation_rows = rows
        width = max(len(r) for r in rows)
        columns = ["step"] + [f"{k}_{i}" for i in range(1, (width - 1) // 3 + 1) for k in ("input", "output", "score")]
        self.run.log({"val/generations": wandb.Table(columns=columns, data=[r + [None] * (width - len(r)) for r in rows])},
                     step=step)

    def finish(self) -> None:
        self.run.finish()


class Tracking:
    """Log metrics to several backends at once (see the module docstring)."""

    def __init__(self, project_name: str, experiment_name: str,
                 default_backend: str | Sequence[str] = "console", config: Any = None,
                 log_dir: str | Path | None = None, stream: TextIO | None = None, wandb_run_id: str | None = None):
        """`default_backend`: trainer.logger (list, or a string such as "[console, wandb]").
        `config`: the run config (DictConfig or mapping); it is masked before any backend sees it.
        `log_dir`: folder for jsonl / tensorboard / wandb files; default `logs/<project>/<experiment>`.
        `wandb_run_id`: continue this wandb run (a resumed training run passes the checkpoint's)."""
        backends = parse_logger(default_backend)
        unknown = [b for b in backends if b not in LOGGER_BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown backend(s) {unknown}; accepted: {list(LOGGER_BACKENDS)}")
        self.project_name, self.experiment_name = project_name, experiment_name
        self.log_dir = Path(log_dir) if log_dir is not None else Path("logs") / project_name / experiment_name
        self.config = mask_secrets(config) if config is not None else None
        self.backends: dict[str, Any] = {}
        for name in dict.fromkeys(backends):  # dedupe, keep order
            if name == "console":
                self.backends[name] = ConsoleBackend(stream)
            elif name == "jsonl":
                self.backends[name] = JsonlBackend(self.log_dir, self.config)
            elif name == "tensorboard":
                self.backends[name] = TensorboardBackend(self.log_dir, self.config)
            elif name == "wandb":
                self.backends[name] = WandbBackend(project_name, experiment_name, self.log_dir, self.config,
                                                   run_id=wandb_run_id)
        self._finished = False

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run's id (stored in checkpoints), or None without wandb."""
        backend = self.backends.get("wandb")
        return backend.run_id if backend is not None else None

    def set_total(self, total_steps: int | None) -> None:
        """Total training steps: the console shows `step k/total`, an ETA and a progress bar."""
        console = self.backends.get("console")
        if console is not None:
            console.set_total(total_steps)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Send one step's metrics to every backend."""
        for backend in self.backends.values():
            backend.log(data, step)

    def log_generations(self, samples: list[dict], step: int) -> None:
        """Validation samples (utils/val_generations.py) to every backend that shows them."""
        if not samples:
            return
        for backend in self.backends.values():
            backend.log_generations(samples, step)

    def finish(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self._finished:
            return
        self._finished = True
        for backend in self.backends.values():
            backend.finish()

    def __enter__(self) -> "Tracking":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()
