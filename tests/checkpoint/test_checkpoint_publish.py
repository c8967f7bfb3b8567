"""Crash safety of checkpoint publishing: staging is invisible, SIGKILL and a full disk (a real tmpfs)
never leave a checkpoint that resume picks up, the previous one stays loadable, cleanup keeps N."""
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_arpo.utils import checkpoint as ck

REPO = Path(__file__).resolve().parents[2]


def _fake_save(root, step, payload="x"):
    staging = ck.begin_checkpoint(root, step)
    os.makedirs(os.path.join(staging, "actor"))
    Path(staging, "actor", "weights.bin").write_text(payload)
    return staging


def _publish_fake(root, step, payload="x"):
    return ck.publish_checkpoint(root, step, _fake_save(root, step, payload))


def _trained_tiny(tiny_model_dir, seed=0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt, AutoTokenizer.from_pretrained(tiny_model_dir)


def _save_real(root, step, model, opt, tok):
    staging = ck.begin_checkpoint(root, step)
    ck.FSDPCheckpointManager(model, opt, processing_class=tok).save_checkpoint(
        os.path.join(staging, "actor"), global_step=step)
    return ck.publish_checkpoint(root, step, staging)


def _assert_loads_equal(path, model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ck.FSDPCheckpointManager(fresh, opt).load_checkpoint(os.path.join(path, "actor"))
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    assert opt.state_dict()["state"], "optimizer state not restored"


def test_staging_is_invisible_until_published(tmp_path):
    root = str(tmp_path / "ckpts")
    staging = _fake_save(root, 1)
    assert staging == ck.staging_dir(root, 1) and os.path.basename(staging) == ".global_step_1.partial"
    assert ck.find_latest_ckpt_path(root) is None and ck.list_checkpoints(root) == []
    final = ck.publish_checkpoint(root, 1, staging)
    assert final == ck.checkpoint_dir(root, 1) and not os.path.exists(staging)
    assert ck.find_latest_ckpt_path(root) == final
    assert Path(root, ck.TRACKER_FILE).read_text() == "1"
    _fake_save(root, 2)  # in progress: still step 1
    assert ck.find_latest_ckpt_path(root) == final
    again = ck.begin_checkpoint(root, 2)  # a stale staging dir of the same step is replaced
    assert os.listdir(again) == []
    assert ck.get_checkpoint_step(os.path.join(final, "actor")) == 1


def test_tracker_fallbacks(tmp_path, caplog):
    root = str(tmp_path)
    _publish_fake(root, 3)
    _publish_fake(root, 5)
    os.makedirs(os.path.join(root, "global_step_9"))  # no completeness marker: ignored
    Path(root, ck.TRACKER_FILE).write_text("7")  # points to a missing dir
    with caplog.at_level(logging.WARNING, logger="verl_arpo"):
        assert ck.find_latest_ckpt_path(root) == ck.checkpoint_dir(root, 5)
    assert "missing or incomplete" in caplog.text
    caplog.clear()
    Path(root, ck.TRACKER_FILE).write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="verl_arpo"):
        assert ck.find_latest_ckpt_path(root) == ck.checkpoint_dir(root, 5)
    assert "cannot read" in caplog.text
    Path(root, ck.TRACKER_FILE).write_text("3")  # the tracker wins over the scan
    assert ck.find_latest_ckpt_path(root) == ck.checkpoint_dir(root, 3)
    assert ck.find_latest_ckpt_path(str(tmp_path / "nope")) is None


def test_republishing_a_step_replaces_it(tmp_path):
    root = str(tmp_path)
    _publish_fake(root, 1, "old")
    path = _publish_fake(root, 1, "new")
    assert Path(path, "actor", "weights.bin").read_text() == "new"
    assert sorted(os.listdir(root)) == ["global_step_1", ck.TRACKER_FILE]


def test_cleanup_keeps_n(tmp_path):
    root = str(tmp_path)
    for step in range(1, 6):
        _publish_fake(root, step)
    _fake_save(root, 2)  # a stale staging dir left by a crash
    assert ck.cleanup_old_checkpoints(root, None) == [os.path.join(root, ".global_step_2.partial")]
    assert [s for s, _ in ck.list_checkpoints(root)] == [1, 2, 3, 4, 5]
    removed = ck.cleanup_old_checkpoints(root, 2)
    assert len(removed) == 3 and [s for s, _ in ck.list_checkpoints(root)] == [4, 5]
    Path(root, ck.TRACKER_FILE).write_text("4")  # never delete what the tracker points to
    ck.cleanup_old_checkpoints(root, 1)
    assert [s for s, _ in ck.list_checkpoints(root)] == [4, 5]


_SLOW_WRITER = """
import os, sys, time
from verl_arpo.utils import checkpoint as ck
staging = ck.begin_checkpoint(sys.argv[1], 2)
os.makedirs(os.path.join(staging, "actor", "model"))
with open(os.path.join(staging, "actor", "model", "__0_0.distcp"), "wb") as f:
    for i in range(100000):
        f.write(os.urandom(1 << 16)); f.flush()
        if i == 2:
            print("writing", flush=True)
        time.sleep(0.02)
"""


def test_sigkill_during_save_keeps_previous(tmp_path, tiny_model_dir):
    root = str(tmp_path / "ckpts")
    model, opt, tok = _trained_tiny(tiny_model_dir)
    step1 = _save_real(root, 1, model, opt, tok)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, root], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert os.path.isdir(ck.staging_dir(root, 2))  # the killed save left its staging dir ...
    assert ck.find_latest_ckpt_path(root) == step1  # ... which resume ignores
    assert Path(root, ck.TRACKER_FILE).read_text() == "1"
    _assert_loads_equal(step1, model, tiny_model_dir)
    ck.cleanup_old_checkpoints(root, 3)
    assert not os.path.exists(ck.staging_dir(root, 2))


def test_disk_full_raises_clear_error_and_keeps_previous(small_tmpfs, tiny_model_dir):
    root = small_tmpfs("ckpts", "4m")
    model, opt, tok = _trained_tiny(tiny_model_dir)
    step1 = _save_real(root, 1, model, opt, tok)
    st = os.statvfs(root)
    filler = os.path.join(root, "filler.bin")
    with open(filler, "wb") as f:  # leave ~64 KiB: less than one model checkpoint
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (64 << 10)))
    staging = ck.begin_checkpoint(root, 2)
    with pytest.raises(ck.CheckpointSaveError) as info:
        ck.FSDPCheckpointManager(model, opt, processing_class=tok).save_checkpoint(
            os.path.join(staging, "actor"), global_step=2)
    msg = str(info.value)
    assert os.path.join(staging, "actor") in msg and "no space left on device" in msg
    assert f"previous checkpoint {step1} is intact" in msg
    ck.abort_checkpoint(staging)
    assert ck.find_latest_ckpt_path(root) == step1
    _assert_loads_equal(step1, model, tiny_model_dir)

    # a full disk while publishing (the completeness marker cannot be written): nothing published
    staging = _fake_save(root, 3)
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with pytest.raises(ck.CheckpointSaveError, match="is intact"):
        ck.publish_checkpoint(root, 3, staging)
    assert Path(root, ck.TRACKER_FILE).read_text() == "1"
    assert not os.path.exists(ck.checkpoint_dir(root, 3))
    assert ck.find_latest_ckpt_path(root) == step1


def test_hf_model_contents_write_a_loadable_folder(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model, _, tok = _trained_tiny(tiny_model_dir)
    actor = str(tmp_path / "actor")
    ck.FSDPCheckpointManager(model, processing_class=tok, checkpoint_contents=("model", "hf_model")
                             ).save_checkpoint(actor, global_step=7)
    assert ck.read_checkpoint_meta(actor)["contents"] == ["model", "hf_model"]
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(actor, "huggingface"), dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="no optimizer state"):
        opt = torch.optim.AdamW(model.parameters())
        ck.FSDPCheckpointManager(model, opt).load_checkpoint(actor)
