"""Run by test_two_hosts.py inside namespace A (``ip netns exec varpmn-a python train_and_probe.py
OUT_DIR override...``): train on the two-host cluster along main_ppo's own path (compose cpu_tiny,
``validate_config``, ``init_ray`` joining ``ray_init.address``, ``run_ppo``), keep the workers, and
write what the test checks but cannot see from outside:

- ``OUT_DIR/probe.json``: the actor group's ``get_node_info`` per rank, with the network namespace
  each rank's process really lives in (``ip netns identify <pid>``);
- ``OUT_DIR/live.pt``: a fresh rollout batch and the live actor's log-probs on it, to compare with
  the checkpoint merged to Hugging Face format.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    out_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.main_ppo import init_ray
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=overrides)
    job = validate_config(cfg)
    init_ray(job)
    _, trainer = run_ppo(job, keep_workers=True)
    try:
        infos = trainer.actor_rollout_wg.execute_all("get_node_info")
        for info in infos:
            ip = shutil.which("ip") or "/usr/sbin/ip"
            ns = subprocess.run([ip, "netns", "identify", str(info["pid"])], capture_output=True, text=True)
            info["netns"] = ns.stdout.strip()
        batch = trainer._collate(trainer.train_dataset, [0, 1])
        batch, _ = trainer._rollout(batch, step=99)
        live = trainer.actor_rollout_wg.compute_log_prob(batch).batch["old_log_probs"]
        b = batch.batch
        keep = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        torch.save({**{k: b[k].clone() for k in keep}, "live_log_probs": live.clone()}, out_dir / "live.pt")
    finally:
        trainer.shutdown()
    (out_dir / "probe.json").write_text(json.dumps({"node_infos": infos}, default=str))


if __name__ == "__main__":
    main()
