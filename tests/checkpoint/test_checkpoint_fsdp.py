"""FSDP2 on 2 gloo ranks: resume is exact, the saved checkpoint merges to an equivalent HF model.

Two spawns in total (module fixture): run 1 trains a step, saves + publishes step 1 and takes step 2;
run 2 (fresh processes, other seeds) resumes from the latest checkpoint and takes step 2 again,
then tries to save into a 256 KiB tmpfs (disk full on both ranks).
"""
import logging
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_dist_helpers import (FIXED_INPUT, free_port, mount_tmpfs, resume_and_step, run_spawned,
                               train_save_continue, umount)

from merge_ckpt import convert_verl_to_hf as conv
from verl_arpo.utils import checkpoint as ck

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp_ckpt")
    root, out, full_root = str(base / "ckpts"), str(base / "out"), str(base / "full")
    os.makedirs(out)
    run_spawned(train_save_continue, (free_port(), tiny_model_dir, root, out), world=2)
    mounted = mount_tmpfs(full_root, "256k")
    try:
        run_spawned(resume_and_step, (free_port(), tiny_model_dir, root, out, full_root if mounted else ""),
                    world=2)
    finally:
        if mounted:
            umount(full_root)
    rec = lambda name: json.loads(Path(out, name).read_text())  # noqa: E731
    return {"root": root, "out": out, "mounted": mounted,
            "run1": [rec(f"run1_rank{r}.json") for r in range(2)],
            "run2": [rec(f"run2_rank{r}.json") for r in range(2)],
            "step1": torch.load(os.path.join(out, "step1.pt")),
            "base": base}


@pytest.fixture(scope="module")
def merged_seed_form(runs):
    """Merge with the seeds' shell script (script path form of the CLI)."""
    target = str(runs["base"] / "hf_seed")
    env = dict(os.environ, VERL_CHECKPOINT=os.path.join(runs["root"], "global_step_1"), OUTPUT_DIR=target,
               PYTHON=sys.executable)
    res = subprocess.run(["bash", "merge_ckpt/convert_checkpoint_from_verl_to_hf_qwen3.sh"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Conversion complete" in res.stdout
    return target


def _hf_logits(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(FIXED_INPUT)).logits, model


def test_resume_is_exact(runs):
    run1, run2 = runs["run1"], runs["run2"]
    assert run2[0]["latest"] == os.path.join(runs["root"], "global_step_1")
    for r in range(2):
        assert run2[r]["loss2"] == run1[r]["loss2"]  # same batch (RNG restored) and same weights
        assert run2[r]["lr"] == run1[r]["lr"]  # lr scheduler restored
    assert run2[0]["data"] == {"epoch": 0, "consumed": 1}
    a = torch.load(os.path.join(runs["out"], "run1_step2.pt"))
    b = torch.load(os.path.join(runs["out"], "run2_step2.pt"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # optimizer moments restored: identical update


def test_checkpoint_layout(runs):
    root = runs["root"]
    assert Path(root, ck.TRACKER_FILE).read_text().strip() == "1"
    actor = Path(root, "global_step_1", "actor")
    for rel in ["model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp", "optim/.metadata",
                "extra_state_rank_0.pt", "extra_state_rank_1.pt", "huggingface/config.json",
                "huggingface/generation_config.json", "huggingface/tokenizer.json", ck.META_FILE]:
        assert (actor / rel).exists(), rel
    meta = ck.read_checkpoint_meta(str(actor))
    assert meta["world_size"] == 2 and meta["global_step"] == 1 and meta["lora"] is None
    assert ck.is_complete_checkpoint(os.path.join(root, "global_step_1"))
    assert not any(n.endswith(".partial") for n in os.listdir(root))
    keys = set(ck.load_model_state_offline(str(actor)))
    assert keys == set(runs["step1"]["state"])  # HF parameter names, no FSDP prefix


def test_two_rank_checkpoint_loads_into_one_process(runs, tiny_model_dir, caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    with caplog.at_level(logging.WARNING, logger="verl_arpo"):
        ck.FSDPCheckpointManager(model, opt, sched).load_checkpoint(
            os.path.join(runs["root"], "global_step_1", "actor"))
    assert "RNG states are not restored" in caplog.text
    ref = runs["step1"]["state"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert sched.last_epoch == 1 and len(opt.state_dict()["state"]) == len(list(model.parameters()))


def test_disk_full_on_two_ranks_raises_everywhere(runs):
    if not runs["mounted"]:
        pytest.skip("cannot mount a tmpfs here")
    for r in range(2):
        msg = runs["run2"][r]["full_error"]
        assert msg is not None, f"rank {r} did not raise"
        assert "no space left on device" in msg and ".global_step_2.partial" in msg


def test_merge_seed_form_matches_fsdp_model(runs, merged_seed_form):
    logits, model = _hf_logits(merged_seed_form)
    assert torch.allclose(logits, runs["step1"]["logits"], atol=1e-5, rtol=0)
    ref = runs["step1"]["state"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(merged_seed_form).eos_token == "<|im_end|>"


def test_merge_verl_form_as_module_sharded(runs):
    target = str(runs["base"] / "hf_verl")
    cmd = [sys.executable, "-m", "merge_ckpt.convert_verl_to_hf", "merge", "--backend", "fsdp",
           "--local_dir", os.path.join(runs["root"], "global_step_1", "actor"), "--target_dir", target,
           "--max_shard_size", "100KB"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert os.path.isfile(os.path.join(target, "model.safetensors.index.json"))
    assert len(list(Path(target).glob("model-*-of-*.safetensors"))) > 1
    logits, _ = _hf_logits(target)
    assert torch.allclose(logits, runs["step1"]["logits"], atol=1e-5, rtol=0)


def test_test_mode_passes_on_itself_and_fails_on_perturbed(runs, merged_seed_form, capsys):
    actor = os.path.join(runs["root"], "global_step_1", "actor")
    argv = ["test", "--backend", "fsdp", "--local_dir", actor, "--test_hf_dir", merged_seed_form]
    assert conv.main(argv) == 0
    perturbed = str(runs["base"] / "hf_perturbed")
    shutil.copytree(merged_seed_form, perturbed)
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(perturbed, "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1e-3
    save_file(sd, os.path.join(perturbed, "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    step_dir = os.path.join(runs["root"], "global_step_1")
    assert conv.main(["--verl_checkpoint", step_dir, "--test_hf_dir", perturbed]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "model.norm.weight" in out


def test_model_type_mismatch_is_a_clear_error(runs, tmp_path, capsys):
    step_dir = os.path.join(runs["root"], "global_step_1")
    rc = conv.main(["--verl_checkpoint", step_dir, "--output_dir", str(tmp_path / "o"),
                    "--model_type", "llama"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--model_type llama" in err and "qwen2" in err


class _Planted:
    """What model-written code could drop into a checkpoint directory: a pickle that runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["extra_state_rank_0.pt", "data.pt"])
def test_a_planted_pickle_in_a_checkpoint_is_refused_not_run(runs, tiny_model_dir, tmp_path, victim):
    """Every torch.load of a checkpoint file is weights_only: a planted file fails the resume with
    an unpickling error instead of running its command."""
    from transformers import AutoModelForCausalLM

    copy = tmp_path / "global_step_1"
    shutil.copytree(os.path.join(runs["root"], "global_step_1"), copy)
    marker = tmp_path / "pwned"
    target = copy / "actor" / victim if victim.startswith("extra") else copy / victim
    assert target.exists()
    torch.save({"rng": _Planted(marker), "global_step": _Planted(marker)}, target)
    with pytest.raises(Exception, match="Weights only load failed"):
        if victim == "data.pt":
            ck.load_dataloader_state(str(copy))
        else:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
            ck.FSDPCheckpointManager(model, torch.optim.AdamW(model.parameters())).load_checkpoint(str(copy / "actor"))
    assert not marker.exists()


class _Opens:
    """A payload that needs no shell: unpickling it creates the marker file (builtins.open)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(step_dir: Path, victim: str, marker: Path) -> Path:
    target = step_dir / victim
    assert target.exists(), sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*"))
    if victim.endswith(".metadata"):
        target.write_bytes(__import__("pickle").dumps(_Opens(marker)))
    else:
        torch.save({"rng": _Opens(marker), "global_step": _Opens(marker)}, target)
    return target


def _load_with(loader: str, step_dir: Path, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    if loader == "resume":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ck.FSDPCheckpointManager(model, torch.optim.AdamW(model.parameters())).load_checkpoint(str(step_dir / "actor"))
    elif loader == "offline":
        ck.load_model_state_offline(str(step_dir / "actor"))
    elif loader == "data":
        ck.load_dataloader_state(str(step_dir))


LOADERS = {"actor/model/.metadata": ["resume", "offline", "merge"], "actor/optim/.metadata": ["resume"],
           "actor/extra_state_rank_0.pt": ["resume"], "data.pt": ["data"]}


@pytest.mark.parametrize("victim,loader", [(v, lo) for v, los in LOADERS.items() for lo in los])
def test_a_payload_in_any_checkpoint_file_never_runs_in_any_loader(runs, tiny_model_dir, tmp_path, capsys, victim,
                                                                   loader):
    """[issue 34, item 1] DCP's `.metadata` is read by a restricted unpickler and its non-tensor entries
    with weights_only (torch 2.13 uses plain pickle for both). Each file of a checkpoint, one at a
    time, through each loader that reads it: the payload never runs, and the error names the file.
    The merge tool checks the manifest first; with the marker gone it still refuses the file."""
    copy = tmp_path / "global_step_1"
    shutil.copytree(os.path.join(runs["root"], "global_step_1"), copy)
    marker = tmp_path / "payload_ran"
    target = _plant(copy, victim, marker)
    if loader == "merge":
        assert conv.main(["--verl_checkpoint", str(copy), "--output_dir", str(tmp_path / "hf")]) == 2
        assert "is damaged" in capsys.readouterr().err and not marker.exists()
        (copy / ck.COMPLETE_MARKER).unlink()   # no manifest to check: the file itself must be refused
        assert conv.main(["--verl_checkpoint", str(copy), "--output_dir", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert str(target) in err and "refused to load" in err
    else:
        with pytest.raises(Exception) as info:
            _load_with(loader, copy, tiny_model_dir, tmp_path)
        assert str(target) in str(info.value) and "refused to load" in str(info.value), info.value
    assert not marker.exists()


def test_a_payload_in_a_dcp_bytes_entry_never_runs(tmp_path):
    """A DCP folder whose non-tensor entry (as optimizer param groups are stored) is a pickled
    payload: torch's own dcp.load runs it; ours refuses it, naming the .distcp file and the entry."""
    import torch.distributed.checkpoint as dcp

    from verl_arpo.utils.checkpoint.safe_load import UnsafeCheckpointError, safe_dcp_load

    marker = tmp_path / "payload_ran"
    folder = tmp_path / "optim"
    dcp.save({"w": torch.ones(2), "param_groups": [{"lr": 0.1, "evil": _Opens(marker)}]}, checkpoint_id=str(folder),
             no_dist=True)
    assert not marker.exists()
    state = {"w": torch.zeros(2), "param_groups": [{"lr": 0.0, "evil": None}]}   # DCP flattens nested entries
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp: refused to load entry 'param_groups\.0\.evil'"):
        safe_dcp_load(state, str(folder), no_dist=True)
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "param_groups": [{"lr": 0.0, "evil": None}]}, checkpoint_id=str(folder), no_dist=True)
    assert marker.exists()   # the payload is live: torch's default planner unpickles it
    marker.unlink()
    # plain data in a bytes entry still loads
    dcp.save({"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": None}]}, checkpoint_id=str(tmp_path / "ok"),
             no_dist=True)
    ok = {"param_groups": [{"lr": 0.0, "betas": None, "name": "x"}]}
    safe_dcp_load(ok, str(tmp_path / "ok"), no_dist=True)
    assert ok["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "name": None}]
