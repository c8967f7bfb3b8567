"""Tracking backends: console line, jsonl, tensorboard, wandb (offline), and no secret in any file."""
import io
import json
from datetime import timedelta

import pytest

from verl_arpo.utils.tracking import ConsoleBackend, Tracking

METRICS = [
    {"critic/score/mean": 0.5, "actor/pg_loss": -0.0123, "response_length/mean": 812.25,
     "tools/calls_per_traj": 2.1, "timing_s/step": 45.2, "actor/entropy": 1.5},
    {"critic/score/mean": 0.75, "actor/pg_loss": 0.01, "rollout/branches": 3, "note": "text"},
]
SECRET = "sk-TRACKING-SECRET-123"
ENV_SECRET = "bd-ENV-SECRET-456"


def _config():
    return {"actor_rollout_ref": {"rollout": {"tools": {"tool_instances": {"search": {"params": {
        "api_key": SECRET, "zone": "z", "endpoint": f"https://x/?key={ENV_SECRET}"}}}}}},
        "trainer": {"project_name": "p", "logger": ["console"]}}


def _all_text(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_jsonl_lines_equal_what_was_logged(tmp_path):
    with Tracking("p", "e", ["jsonl"], log_dir=tmp_path) as tracker:
        for step, m in enumerate(METRICS, 1):
            tracker.log(m, step=step)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": s, **m} for s, m in enumerate(METRICS, 1)]


def test_jsonl_converts_numpy_and_torch_scalars(tmp_path):
    import numpy as np
    import torch

    with Tracking("p", "e", "jsonl", log_dir=tmp_path) as tracker:
        tracker.log({"a": np.float32(0.5), "b": torch.tensor(2), "c": np.int64(3)}, step=7)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 7, "a": 0.5, "b": 2, "c": 3}


def test_tensorboard_event_file_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("p", "e", ["tensorboard"], log_dir=tmp_path, config=_config()) as tracker:
        for step, m in enumerate(METRICS, 1):
            tracker.log(m, step=step)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("critic/score/mean")] == [0.5, 0.75]
    assert "note" not in acc.Tags()["scalars"]


def test_wandb_offline_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracking("p", "e", ["wandb"], log_dir=tmp_path, config=_config()) as tracker:
        tracker.log(METRICS[0], step=1)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_console_line_format():
    out = io.StringIO()
    tracker = Tracking("p", "e", ["console"], stream=out)
    tracker.log(METRICS[0], step=3)
    tracker.set_total(10)
    tracker.log(METRICS[1], step=4)
    tracker.finish()
    first, second = out.getvalue().splitlines()
    assert first == "step 3 | score 0.5 | pg_loss -0.0123 | resp_len 812.2 | tool_calls 2.1 | step_s 45.2"
    assert second.startswith("step 4/10 | score 0.75 | pg_loss 0.01 | eta ")


def test_console_eta():
    console = ConsoleBackend(io.StringIO())
    console.set_total(10)
    console._t0, console._step0 = 100.0, 1
    assert console.eta(3, now=120.0) == timedelta(seconds=70)  # 10 s/step × 7 steps left
    assert console.eta(1, now=120.0) is None


def test_unknown_backend_names_the_key():
    accepted = r"accepted: \['console', 'wandb', 'tensorboard', 'jsonl'\]"
    with pytest.raises(ValueError, match=r"trainer\.logger.*mlflow.*" + accepted):
        Tracking("p", "e", ["console", "mlflow"])


def test_string_logger_like_the_seeds(tmp_path):
    tracker = Tracking("p", "e", "[console, jsonl]", log_dir=tmp_path, stream=io.StringIO())
    assert list(tracker.backends) == ["console", "jsonl"]
    tracker.finish()


def test_no_backend_writes_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", ENV_SECRET)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    backends = ["console", "jsonl", "tensorboard"]
    try:
        import wandb  # noqa: F401

        backends.append("wandb")
    except ImportError:
        pass
    out = io.StringIO()
    with Tracking("p", "e", backends, log_dir=tmp_path, config=_config(), stream=out) as tracker:
        tracker.log(METRICS[0], step=1)
    files = _all_text(tmp_path)
    assert (tmp_path / "config.json").exists() and len(files) >= 3
    for path, data in files.items():
        assert SECRET.encode() not in data and ENV_SECRET.encode() not in data, path
    assert json.loads((tmp_path / "config.json").read_text())["actor_rollout_ref"]["rollout"]["tools"][
        "tool_instances"]["search"]["params"]["api_key"] == "***"
    assert SECRET not in out.getvalue()


def test_wandb_settings_fail_closed():
    """[issue 34, item 6] The fallback for an older wandb dropped every privacy field (fail open).
    It keeps x_disable_meta, or refuses: checked against wandb's own Settings and against a settings
    class of an API without that field."""
    import wandb

    from verl_arpo.utils.tracking import private_wandb_settings

    assert private_wandb_settings(wandb.Settings).x_disable_meta is True

    class WithoutCodeFields:   # an API that knows x_disable_meta but not disable_code / disable_git
        def __init__(self, x_disable_meta, silent):
            self.x_disable_meta, self.silent = x_disable_meta, silent

    assert private_wandb_settings(WithoutCodeFields).x_disable_meta is True

    class WithoutMeta:         # an API that cannot turn the host metadata off
        def __init__(self, silent=False):
            self.silent = silent

    with pytest.raises(RuntimeError, match="cannot turn off its host metadata"):
        private_wandb_settings(WithoutMeta)


def test_training_steps_reads_back_one_row_a_step_the_last_line_winning(tmp_path):
    """A resumed run appends to metrics.jsonl: the line logged last for a step counts; a line that is not a
    training step's (no score) is skipped; rows come in step order."""
    from verl_arpo.utils.tracking import training_steps

    f = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.6},
             {"step": 2, "val/accuracy": 0.7}, {"step": 2, "critic/score/mean": 0.65}, {"step": 0, "critic/score/mean": 0.1}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert training_steps(f) == [lines[4], lines[0], lines[3]]
