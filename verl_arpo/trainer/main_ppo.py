"""Training entry point (Hydra): ``python -m verl_arpo.trainer.main_ppo [key=value ...]``.

    python -m verl_arpo.trainer.main_ppo actor_rollout_ref.model.path=/models/qwen data.train_files=...
    python -m verl_arpo.trainer.main_ppo --config-name=ppo_trainer_dr ...      # deep-research preset
    python -m verl_arpo.trainer.main_ppo --config-path=/my/configs --config-name=my.yaml ...
    python -m verl_arpo.trainer.main_ppo --cfg job ...                        # print the config, run nothing

The configs come from the repository's ``configs/`` folder whatever the working directory (the
package sits next to it in a source checkout or an editable install); ``--config-path`` replaces it,
as in the seeds' scripts. Hydra does not change the working directory, and it keeps no ``.hydra/``
copy of the config (that copy would hold API keys in clear); a masked ``config.yaml`` is written to
the Hydra run dir (``hydra.run.dir``) instead.

Order of events, so that a bad value costs seconds rather than a Ray start-up: write the masked
config → build the typed ``JobConfig`` and print its summary → check every value rule
(``validate_config``: every problem at once, exit code 2) → import the trainer → start or join Ray
→ ``run_ppo(job)``. Everything after the build reads the one ``JobConfig``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from verl_arpo.trainer.config import ConfigError, mask_secrets, validate_config
from verl_arpo.trainer.local_ray import LocalRayHead
from verl_arpo.utils.resources import config_dir
from verl_arpo.config import JobConfig
from verl_arpo.config.run import DEFAULT_RAY_ENV

CONFIG_DIR = config_dir()
"""Absolute path of the repository's configs/ folder (Hydra's default --config-path)."""


def format_config(cfg: DictConfig) -> str:
    """The masked, resolved config as YAML (a ??? value is printed as ???)."""
    return OmegaConf.to_yaml(OmegaConf.create(mask_secrets(cfg)))


def save_masked_config(cfg: DictConfig, out_dir: str | Path | None = None) -> Path | None:
    """Write the masked config to `<out_dir>/config.yaml`; default out_dir: the Hydra run dir (None outside Hydra)."""
    if out_dir is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        try:  # a compose() without a run (tests, notebooks) leaves HydraConfig without a run dir
            out_dir = HydraConfig.get().runtime.output_dir
        except Exception:  # noqa: BLE001 - omegaconf's MissingMandatoryValue and friends
            return None
    path = Path(out_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_config(cfg), encoding="utf-8")
    return path


def load_run_ppo():
    """`run_ppo` from the trainer, or an ImportError that says what is missing."""
    try:
        from verl_arpo.trainer.ppo.ray_trainer import run_ppo
    except ImportError as exc:
        raise ImportError(
            "cannot import verl_arpo.trainer.ppo.ray_trainer.run_ppo, the training driver "
            f"({type(exc).__name__}: {exc}). The config is valid; the trainer module is missing or "
            "broken in this checkout."
        ) from exc
    return run_ppo


_HEAD: LocalRayHead | None = None
"""The head `init_ray(own_session=True)` started; `shutdown_ray` stops it."""


def set_driver_env(job: JobConfig) -> None:
    """The driver's own environment, with or without Ray: DEFAULT_RAY_ENV where unset, and the
    credentials of ray_init.runtime_env.env_vars (its reward functions may read them). The other
    env_vars go to the workers (Ray's runtime_env, or LocalWorkerGroup's env_vars)."""
    for key, value in DEFAULT_RAY_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update(job.ray_init.worker_env.secrets)


def init_ray(job: JobConfig, own_session: bool = False) -> bool:
    """Start a local Ray cluster, or join `ray_init.address`. Returns True when this call started Ray.
    With `own_session` (the command line) a local cluster is a `ray start` head in its own session,
    out of reach of a signal to the driver's process group (trainer/local_ray.py)."""
    global _HEAD
    import ray

    if ray.is_initialized():
        return False
    set_driver_env(job)
    ray_cfg = job.ray_init
    runtime_env = dict(ray_cfg.runtime_env or {})  # free-form: Ray's runtime_env fields
    # Ray's runtime-env agent writes the whole runtime_env into its log: credentials stay out of it.
    # The driver keeps them in its environment (its reward functions), and the trainer hands them to
    # every worker with a method call before the workers build anything (RayPPOTrainer.init_workers)
    runtime_env["env_vars"] = dict(ray_cfg.worker_env.public)
    if ray_cfg.address:
        ray.init(address=str(ray_cfg.address), runtime_env=runtime_env)
    elif own_session:
        _HEAD = LocalRayHead(ray_cfg.num_cpus, bool(ray_cfg.include_dashboard), env=runtime_env["env_vars"])
        try:
            ray.init(address=_HEAD.start(), runtime_env=runtime_env)
        except BaseException:
            _HEAD.stop()
            _HEAD = None
            raise
    else:
        ray.init(num_cpus=int(ray_cfg.num_cpus) if ray_cfg.num_cpus else None, runtime_env=runtime_env,
                 include_dashboard=bool(ray_cfg.include_dashboard))
    return True


def shutdown_ray() -> None:
    """Leave Ray, and stop the head `init_ray(own_session=True)` started."""
    global _HEAD
    import ray

    ray.shutdown()
    if _HEAD is not None:
        _HEAD.stop()
        _HEAD = None


def config_summary(job: JobConfig, full: Path | None) -> str:
    """One screen: what this run trains, on what, how long, and where the full config is."""
    model, actor, r = job.actor_rollout_ref.model, job.actor_rollout_ref.actor, job.actor_rollout_ref.rollout
    d, t = job.data, job.trainer
    branching = (f"ARPO/AEPO branching ({r.branch_rule}, initial_rollouts={r.initial_rollouts})"
                 if r.initial_rollouts else "no branching")
    lines = [
        f"model     {model.path}",
        f"algorithm {job.algorithm.adv_estimator}, {branching}, lr {actor.optim.lr}",
        f"rollout   {r.name} engine, n={r.n}, temperature {r.temperature}, "
        f"prompt/response tokens {d.max_prompt_length}/{d.max_response_length}",
        f"data      train {d.train_files} ({d.train_batch_size} prompts/step), val {d.val_files}",
        f"run       {t.nnodes} node(s) x {t.n_gpus_per_node} workers on {t.device}"
        f"{' in this process (single_process)' if t.single_process else ''}, steps "
        f"{t.total_training_steps or 'all epochs'} ({t.total_epochs} epoch(s)), save_freq {t.save_freq}, "
        f"test_freq {t.test_freq}, logger {t.loggers}",
        f"output    {t.default_local_dir}",
        f"config    {full if full else 'python -m verl_arpo.trainer.main_ppo --cfg job <same overrides> prints it'}",
    ]
    return "\n".join("[verl_arpo] " + line for line in lines)


def run(cfg: DictConfig) -> Any:
    """Build the typed config, summarise, start Ray, train. Raises ConfigError before anything is
    started. The full masked config goes to a file (Hydra's run dir), not to the console."""
    full = save_masked_config(cfg)
    job = validate_config(cfg, on_typed=lambda typed: print(config_summary(typed, full), flush=True))
    from verl_arpo.trainer.ppo.run_directory import RunDirectory

    # the lock and the checkpoint to resume are checked before anything slow starts: a second run, a
    # changed run or a damaged resume_path is refused in seconds (docs/checkpoints.md)
    run_dir = RunDirectory(job).claim()
    try:
        return _train(job, run_dir)
    finally:
        run_dir.release_lock()   # the trainer's shutdown released it already, unless it never started


def _train(job: JobConfig, run_dir) -> Any:
    if job.trainer.single_process:   # the worker lives in this process (single_controller/local.py): no Ray
        set_driver_env(job)
        return load_run_ppo()(job, run_dir=run_dir)
    own_session = not job.ray_init.address and "ray" not in sys.modules
    if own_session:
        # the head init_ray starts (`ray start`) turns token authentication on, and a driver joining a
        # cluster by its address must say so before Ray is imported (Ray reads it once, at import;
        # the token is in ~/.ray/auth_token). A user's own RAY_AUTH_MODE is kept.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    run_ppo = load_run_ppo()
    started = init_ray(job, own_session=own_session)
    try:
        return run_ppo(job, run_dir=run_dir)
    finally:
        if started:
            shutdown_ray()


def main() -> None:
    """The command line (`python -m verl_arpo.trainer.main_ppo`, `verl-arpo-train`): Hydra, with every
    printing form masked and unknown keys named before anything starts (trainer/config_cli.py)."""
    from verl_arpo.trainer import config_cli
    from verl_arpo.utils.threads import cpu_process_env

    # before torch loads (libgomp reads it then): this process computes with trainer.single_process
    os.environ.update(cpu_process_env())
    argv = sys.argv[1:]
    cli = config_cli.parse_cli(argv, CONFIG_DIR)
    try:
        if cli.cfg_type is not None:
            config_cli.print_config(cli)
            return
        if any(a.partition("=")[0] in config_cli.PAGE_FLAGS for a in argv):
            config_cli.print_masked_page(hydra_main)
            return
        if not cli.other_flags:   # a plain run: unknown keys fail here, in one line, as with --cfg job
            config_cli.compose_checked(cli._replace(overrides=[o for o in cli.overrides
                                                               if not o.lstrip("+~").startswith("hydra")]))
    except ConfigError as exc:
        print(f"[verl_arpo] {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if not any(o.lstrip("+~").startswith("hydra.output_subdir") for o in cli.overrides):
        # no .hydra/ copy of the config (it holds credentials in clear), whatever --config-path says
        sys.argv.append("hydra.output_subdir=null")
    hydra_main()


def run_refusal(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, advice) for a refusal at run time, or None for a failure that keeps its traceback.

    Exit codes: 2 a config problem (ConfigError, also raised when the cluster cannot hold the
    workers), 3 the run directory is locked by another run, 4 the checkpoint to resume belongs to a
    run with other settings, 5 a worker call ran past trainer.worker_call_timeout, 6 a tool outage passed
    actor_rollout_ref.rollout.tools.infra_failure_stop_rate (after a checkpoint)."""
    from verl_arpo.single_controller.ray.base import WorkerGroupTimeoutError
    from verl_arpo.trainer.ppo.tool_outages import ToolOutageError
    from verl_arpo.trainer.ppo.run_directory import DifferentRunError
    from verl_arpo.utils.checkpoint.integrity import RunDirLockedError

    chain = []
    while exc is not None and len(chain) < 8:   # the trainer's guard wraps a worker error in its own
        chain.append(exc)
        exc = exc.__cause__
    for e in chain:
        if isinstance(e, RunDirLockedError):
            return 3, ""
        if isinstance(e, DifferentRunError):
            return 4, ""
        if isinstance(e, WorkerGroupTimeoutError):
            return 5, (" Raise trainer.worker_call_timeout if the call is only slow, or read that worker's log; "
                       "trainer.resume_mode=auto continues from the last checkpoint in trainer.default_local_dir")
        if isinstance(e, ToolOutageError):
            return 6, ""
    return None


@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    """Hydra entry; a config problem exits with code 2 and one line per problem, a refusal at run time
    (run_refusal) with its own code and one line; HYDRA_FULL_ERROR=1 shows their tracebacks."""
    from verl_arpo.trainer.ppo.preemption import Preempted

    try:
        run(cfg)
    except ConfigError as exc:
        print(f"[verl_arpo] {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Preempted as exc:
        print(f"[verl_arpo] {exc}", file=sys.stderr, flush=True)
        raise
    except Exception as exc:
        refusal = run_refusal(exc)
        if refusal is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        code, advice = refusal
        line = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"[verl_arpo] {line}{advice} (exit {code})", file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
