"""The typed trainer configuration: one frozen dataclass per section of configs/ppo_trainer.yaml.

The YAML stays the user-facing reference (Hydra composes it with the presets and the command line;
`--cfg job` prints it; docs/configuration.md is generated from its comments). Right after Hydra
composes, the tree is turned into a `JobConfig` once (`JobConfig.checked`): every value is checked
against its field's type (config/typed.py), then against the value rules, and every problem is
reported at once as a ConfigError naming the key and the fix. That object is what the summary, Ray
start-up, the trainer and the workers read: no `.get(key, default)` in the code that uses it, so a
default lives in exactly two places that a test keeps equal, the YAML and the dataclass field.

    JobConfig                                        config/__init__.py (this file)
      data               DataConfig                  config/run.py
      actor_rollout_ref  ActorRolloutRefConfig
        model, actor (optim, fsdp_config, ...), ref  config/training.py
        rollout          RolloutSection              config/rollout.py
      critic             CriticConfig                config/training.py
      reward_model, custom_reward_function, algorithm, ray_init, trainer   config/run.py

Where a rule lives: a rule on one section's keys is that section's `problems(where)`; a rule that
reads several sections (batch sizes against the worker count, token budgets against the lengths,
the critic under gae, the device against the cluster) is `JobConfig.problems`. Choices are
`Literal` types (their values are the one list of accepted names); names looked up in a registry
(`adv_estimator`, `policy_loss.loss_mode`, `branch_rule`) are checked against the registries the
composition root hands in (`names`: `verl_arpo.trainer.config.registered_names`), since the
algorithms that fill them sit above this package.

Values that are *derived* from several keys are computed once, here, and named (`JobConfig.derived`):
world size, whether a KL term is active, whether the reference model and the critic are needed,
whether the update is strictly on-policy, and each worker's batch sizes (`Batching`: verl's
`ppo_mini_batch_size` counts prompts, a worker runs trajectories). User keys are never rewritten.

A key the code does not read yet is listed in `NOT_IMPLEMENTED` with what to use instead; a
non-default value there is a configuration error, never silently ignored. Unknown keys fail with the
key named (Hydra's struct mode does this first on the command line; `from_mapping` for any other
mapping).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from verl_arpo.config.rollout import (ROLLOUT_MODES, ROLLOUT_NAMES, VLLM_ONLY_KEYS, MultiTurnConfig,
                                      RolloutSection, ToolsConfig, ValKwargs)
from verl_arpo.config.run import (AlgorithmConfig, CustomRewardFunctionConfig, DataConfig, KLCtrlConfig,
                                  RayInitConfig, RewardModelConfig, TrainerConfig)
from verl_arpo.config.training import (MODEL_DTYPE_NAMES, ActorConfig, CheckpointConfig, CriticConfig,
                                       CriticModelConfig, FSDPConfig, ModelConfig, OptimConfig,
                                       MixedPrecisionConfig, PolicyLossConfig, RefConfig, RefFSDPConfig,
                                       resolve_model_dtype)
from verl_arpo.config.typed import ConfigError, Problems, build, choices, from_mapping, plain_tree, to_dict
from verl_arpo.utils.chat_template import load_chat_template

__all__ = ["ConfigError", "JobConfig", "Derived", "Batching", "RolloutCorrection", "DataConfig",
           "ModelConfig", "ActorConfig", "RefConfig", "RolloutSection", "CriticConfig", "ToolsConfig",
           "AlgorithmConfig", "TrainerConfig", "OptimConfig", "FSDPConfig", "RefFSDPConfig",
           "MixedPrecisionConfig", "CriticModelConfig", "PolicyLossConfig", "CheckpointConfig",
           "KLCtrlConfig", "MultiTurnConfig", "ValKwargs", "RayInitConfig", "RewardModelConfig",
           "CustomRewardFunctionConfig", "ActorRolloutRefConfig", "ROLLOUT_MODES", "ROLLOUT_NAMES",
           "VLLM_ONLY_KEYS", "MODEL_DTYPE_NAMES", "resolve_model_dtype", "from_mapping", "to_dict",
           "choices", "NOT_IMPLEMENTED", "TYPE_IS_THE_RULE", "not_implemented_problems", "kl_term_active"]

AR = "actor_rollout_ref"


def kl_term_active(enabled: Any, coef: Any) -> bool:
    """A KL term (the actor's KL loss, or the in-reward KL) counts only when it is switched on *and*
    its weight is non-zero: `use_kl_loss=true, kl_loss_coef=0` (as in the seeds' scripts) is off,
    so no reference forward runs and no `ref_log_prob` is needed (docs/algorithms.md, "The policy
    loss shared by all of them"). The one definition `JobConfig.derived` and the actor use."""
    try:
        weight = float(coef)
    except (TypeError, ValueError):
        return False
    return bool(enabled) and weight != 0.0 and weight == weight


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: Literal[True] = field(default=True, metadata={
        "hint": "only the colocated (hybrid) engine is implemented: set it to true"})
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass(frozen=True)
class Batching:
    """How one worker splits its share of a batch into forward (and backward) passes, in trajectories
    per worker: verl's user keys count prompts (`ppo_mini_batch_size`) or all workers (the deprecated
    global micro sizes); these are what a worker runs. Built by `JobConfig.derived`, nowhere else."""

    micro_batch: int
    """trajectories per forward without dynamic batch sizes."""
    use_dynamic_bsz: bool
    """micro-batches by token budget instead of by count."""
    max_token_len: int
    """the token budget of a micro-batch with use_dynamic_bsz."""
    mini_batch: int | None = None
    """trajectories per optimizer step on this worker (updates only)."""

    # Under Ulysses sequence parallelism (sp = S > 1) the S ranks of an sp group hold one batch between
    # them: a "worker" here is a data-parallel replica (world ÷ S of them), and a token budget "per
    # gpu" is S× that per micro-batch, since each rank holds 1/S of its tokens (verl's meaning).
    @classmethod
    def for_update(cls, section: "ActorConfig | CriticConfig", n: int, world: int, sp: int = 1) -> "Batching":
        """An actor's or critic's update: ppo_mini_batch_size prompts × n ÷ (world ÷ sp) trajectories per step."""
        dp = max(1, int(world) // int(sp))  # 0 only for a refused config (S > ranks), which never runs
        return cls(_micro_per_worker(section.ppo_micro_batch_size, section.ppo_micro_batch_size_per_gpu, dp),
                   bool(section.use_dynamic_bsz), int(section.ppo_max_token_len_per_gpu) * int(sp),
                   mini_batch=int(section.ppo_mini_batch_size) * int(n) // dp)

    @classmethod
    def for_log_prob(cls, section: "RolloutSection | RefConfig", world: int, sp: int = 1) -> "Batching":
        """A log-prob pass from its log_prob_* keys (rollout: the actor's old log-probs; ref)."""
        return cls(_micro_per_worker(section.log_prob_micro_batch_size, section.log_prob_micro_batch_size_per_gpu,
                                     max(1, int(world) // int(sp))), bool(section.log_prob_use_dynamic_bsz),
                   int(section.log_prob_max_token_len_per_gpu) * int(sp))

    @classmethod
    def for_values(cls, critic: "CriticConfig", world: int, sp: int = 1) -> "Batching":
        """The critic's value pass: its micro size, forward_max_token_len_per_gpu."""
        return cls(_micro_per_worker(critic.ppo_micro_batch_size, critic.ppo_micro_batch_size_per_gpu,
                                     max(1, int(world) // int(sp))),
                   bool(critic.use_dynamic_bsz), int(critic.forward_max_token_len_per_gpu) * int(sp))


def _micro_per_worker(global_size: int | None, per_gpu: int, dp: int) -> int:
    """verl's deprecated global micro batch (over all data-parallel replicas) wins when it is set."""
    return int(global_size) // dp if global_size is not None else int(per_gpu)


@dataclass(frozen=True)
class RolloutCorrection:
    """The algorithm.rollout_is_* settings the actor's update needs (docs/algorithms.md, "Rollout
    correction"): importance weights exp(log π_old − log π_rollout), capped at `threshold`, per token
    or per sequence (`level`), recorded as metrics, and applied to the policy loss when `apply`."""

    threshold: float
    level: str = "token"
    mode: str = "truncate"
    apply: bool = False


@dataclass(frozen=True)
class Derived:
    """Facts that depend on several keys, computed once by `JobConfig.derived`: user keys keep the
    meaning they have in the YAML, and whatever a worker needs in other units is a field here."""

    world_size: int
    """trainer.nnodes × trainer.n_gpus_per_node: the ranks of the actor (and of the critic)."""
    actor_sp: int
    """actor.ulysses_sequence_parallel_size: ranks per actor sp group (world ÷ actor_sp data-parallel replicas)."""
    critic_sp: int
    """critic.ulysses_sequence_parallel_size."""
    kl_loss_active: bool
    """actor.use_kl_loss and kl_loss_coef ≠ 0 (core_algos.kl_term_active)."""
    kl_in_reward_active: bool
    """algorithm.use_kl_in_reward and kl_ctrl.kl_coef ≠ 0."""
    need_ref: bool
    """a reference model is built and run: an active KL loss or in-reward KL."""
    need_critic: bool
    """algorithm.adv_estimator == gae."""
    on_policy: bool
    """one epoch over one mini-batch and nothing else reading π_old: the update's own forward gives
    π_old (detached) and the separate old-log-prob pass is skipped."""
    actor_update: Batching
    """the actor's update: ppo_mini_batch_size prompts × rollout.n ÷ world per optimizer step."""
    actor_log_prob: Batching
    """the actor's old-log-prob pass (rollout.log_prob_*)."""
    ref_log_prob: Batching
    """the reference's log-prob pass (ref.log_prob_*)."""
    critic_update: Batching
    """the critic's update: critic.ppo_mini_batch_size prompts × rollout.n ÷ world per step."""
    critic_values: Batching
    """the critic's value pass (its micro size, forward_max_token_len_per_gpu)."""
    rollout_correction: RolloutCorrection | None = None
    """algorithm.rollout_is_threshold and its keys (None: off); the actor gets it when it is built."""
    temperature: float = 1.0
    """rollout.temperature: the log-prob passes and the update divide the logits by it, as the
    engine did when it sampled (the actor gets it when it is built, not with each batch)."""
    chat_template: str | None = None
    """data.custom_chat_template (the file's text when it names one): the rollout renders the hermes
    format's tool messages with the template that rendered the prompts."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """data.apply_chat_template_kwargs, for the same reason."""


@dataclass(frozen=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @functools.cached_property
    def derived(self) -> Derived:
        a, algo, t = self.actor_rollout_ref.actor, self.algorithm, self.trainer
        world = int(t.nnodes) * int(t.n_gpus_per_node)
        kl_loss = kl_term_active(a.use_kl_loss, a.kl_loss_coef)
        kl_reward = kl_term_active(algo.use_kl_in_reward, algo.kl_ctrl.kl_coef)
        r, ref, c = self.actor_rollout_ref.rollout, self.actor_rollout_ref.ref, self.critic
        n = int(r.n)
        trajectories = int(self.data.train_batch_size) * n
        on_policy = (a.skip_old_log_prob_on_policy and a.ppo_epochs == 1 and a.ppo_mini_batch_size * n >= trajectories
                     and not kl_reward)
        asp, csp = max(1, int(a.ulysses_sequence_parallel_size)), max(1, int(c.ulysses_sequence_parallel_size))
        correction = None
        if algo.rollout_is_threshold is not None:
            correction = RolloutCorrection(float(algo.rollout_is_threshold), algo.rollout_is_level,
                                           algo.rollout_is_mode, bool(algo.rollout_is))
        return Derived(
            world_size=world, actor_sp=asp, critic_sp=csp, kl_loss_active=kl_loss, kl_in_reward_active=kl_reward,
            need_ref=kl_loss or kl_reward, need_critic=algo.adv_estimator == "gae", on_policy=on_policy,
            actor_update=Batching.for_update(a, n, world, asp), actor_log_prob=Batching.for_log_prob(r, world, asp),
            ref_log_prob=Batching.for_log_prob(ref, world, asp), critic_update=Batching.for_update(c, n, world, csp),
            critic_values=Batching.for_values(c, world, csp), rollout_correction=correction,
            temperature=float(r.temperature),
            chat_template=load_chat_template(self.data.custom_chat_template),
            chat_template_kwargs=dict(self.data.apply_chat_template_kwargs or {}))

    @classmethod
    def from_mapping(cls, data: Any) -> "JobConfig":
        """Build from a composed OmegaConf tree or a plain mapping; a value of the wrong type or an
        unknown key raises ConfigError (the value rules are `checked`'s)."""
        return from_mapping(cls, data, "")

    @classmethod
    def checked(cls, data: Any, on_typed: Callable[["JobConfig"], None] | None = None,
                names: "RegisteredNames | None" = None) -> "JobConfig":
        """Build and check: every type problem and every value rule at once, as one ConfigError, or the
        config. A section with a type problem skips its value rules (its bad value was replaced by the
        default, and a rule on that default would only mislead), and so do the cross-section rules.
        `on_typed(job)` runs once every value has its type, before the value rules (main_ppo prints
        the run's summary there, so a user sees what was asked even when a value is refused)."""
        if isinstance(data, cls):
            job, typing_problems = data, []
        else:
            tree = plain_tree(data)
            if isinstance(tree, dict):
                tree.pop("hydra", None)  # Hydra's own node (`--cfg all`): not ours to check
            job, typing_problems = build(cls, tree, "")
        if on_typed is not None and not typing_problems:
            on_typed(job)
        problems = typing_problems + job.problems(skip=[key for key, _ in typing_problems], names=names)
        if problems:
            raise ConfigError(problems)
        return job

    def problems(self, skip: list[str] = (), names: "RegisteredNames | None" = None) -> Problems:
        """The value rules, section by section and then across sections; `skip` lists keys with a type
        problem (their sections, and the cross-section rules, are not checked); `names` the keys that
        must name a registry entry (RegisteredNames), checked with their sections."""
        out: Problems = []
        for where, section in _sections(self, ""):
            # the critic's rules count only when a critic is built (adv_estimator=gae: below)
            if where and where.split(".")[0] != "critic" \
                    and not any(k == where or k.startswith(where + ".") for k in skip):
                out += section.problems(where) if hasattr(section, "problems") else []
                out += _unknown_names(section, where, names or {})
        if not skip:
            out += self._cross_section_problems() + not_implemented_problems(self)
        return out

    def _cross_section_problems(self) -> Problems:
        out: Problems = []
        t, d, ar = self.trainer, self.data, self.actor_rollout_ref
        if d.train_batch_size >= 1 and ar.rollout.n >= 1 and t.nnodes >= 1 and t.n_gpus_per_node >= 1:
            sp_problems = _sequence_parallel_problems(self)
            out += sp_problems
            if not sp_problems:  # the batch arithmetic divides by world ÷ S
                out += _batch_problems(self)
        one_seq = d.max_prompt_length + d.max_response_length
        for flag, budget, key in (
                (ar.actor.use_dynamic_bsz, ar.actor.ppo_max_token_len_per_gpu, f"{AR}.actor.ppo_max_token_len_per_gpu"),
                (ar.rollout.log_prob_use_dynamic_bsz, ar.rollout.log_prob_max_token_len_per_gpu,
                 f"{AR}.rollout.log_prob_max_token_len_per_gpu"),
                (ar.ref.log_prob_use_dynamic_bsz, ar.ref.log_prob_max_token_len_per_gpu,
                 f"{AR}.ref.log_prob_max_token_len_per_gpu")):
            if flag and budget < one_seq:
                out.append((key, f"token budget {budget} < max_prompt_length + max_response_length = {one_seq}: one "
                            "full sequence must fit (the seeds use 2-4 × that sum)"))
        if self.algorithm.rollout_is_threshold is not None and not ar.rollout.calculate_log_probs:
            out.append((f"{AR}.rollout.calculate_log_probs", "must be true when algorithm.rollout_is_threshold is "
                        "set: the importance weights need the engine's log-probs"))
        if self.algorithm.adv_estimator == "gae":
            out += self.critic.gae_problems("critic")
        if t.single_process:
            out += _single_process_problems(self.ray_init)
        if t.device == "cuda" and not self.ray_init.address:
            # a local cluster is this machine; a remote one is checked against its resources after Ray is up
            import torch

            if not torch.cuda.is_available():
                out.append(("trainer.device", "cuda requested but no CUDA device is visible: use trainer.device=cpu "
                            "or auto"))
        return out


def _single_process_problems(ray_init: RayInitConfig) -> Problems:
    """trainer.single_process starts no Ray: a ray_init setting it would not honour is an error (its
    env_vars are set in the driver's environment instead, and num_cpus caps the worker's threads)."""
    out: Problems = []
    fix = "with trainer.single_process=true no Ray cluster is started or joined: "
    if ray_init.address:
        out.append(("ray_init.address", fix + "unset it, or set trainer.single_process=false"))
    if ray_init.include_dashboard:
        out.append(("ray_init.include_dashboard", fix + "set it to false"))
    other = sorted(k for k in (ray_init.runtime_env or {}) if k != "env_vars")
    if other:
        out.append(("ray_init.runtime_env", fix + f"only env_vars applies (to this process); remove {other}"))
    return out


RegisteredNames = Mapping[str, tuple[Collection[str], str]]
"""Dotted key → (the names its registry holds, a hint printed after them). The registries live above the
config (the algorithms register themselves where they are defined), so the composition root hands them
in: `verl_arpo.trainer.config.registered_names()`."""


def _unknown_names(section: Any, where: str, names: RegisteredNames) -> Problems:
    """A problem for each key of `section` (at `where`) in `names` whose value its registry does not hold."""
    out: Problems = []
    for key, (accepted, hint) in names.items():
        parent, leaf = key.rsplit(".", 1)
        if parent == where and (value := getattr(section, leaf)) not in accepted:
            out.append((key, f"unknown {value!r}; accepted: {sorted(accepted)}{hint}"))
    return out


def _sections(obj: Any, where: str):
    """(dotted key, section) for `obj` and every section below it, parents first."""
    yield where, obj
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from _sections(value, f"{where}.{f.name}".lstrip("."))


def _batch_problems(job: JobConfig) -> Problems:
    """verl's batch arithmetic: prompts × n trajectories split evenly over the workers, mini-batches
    dividing the batch, micro-batches dividing a worker's share (docs/configuration.md)."""
    out: Problems = []
    bsz, n, world = job.data.train_batch_size, job.actor_rollout_ref.rollout.n, job.derived.world_size
    if bsz * n % world:
        out.append(("data.train_batch_size", f"train_batch_size × rollout.n = {bsz} × {n} = {bsz * n} trajectories "
                    f"do not split evenly over {world} workers (trainer.n_gpus_per_node × trainer.nnodes): "
                    "change the batch size, rollout.n or the worker count"))
    actor_dp = world // job.derived.actor_sp
    out += _mini_batch_problems(job.actor_rollout_ref.actor, f"{AR}.actor", bsz, n, actor_dp)
    for where, section in ((f"{AR}.rollout", job.actor_rollout_ref.rollout), (f"{AR}.ref", job.actor_rollout_ref.ref)):
        old = section.log_prob_micro_batch_size
        if old is not None and (old < actor_dp or old % actor_dp):
            out.append((f"{where}.log_prob_micro_batch_size", f"(deprecated, global) must be a multiple of the "
                        f"{actor_dp} data-parallel workers; better set log_prob_micro_batch_size_per_gpu instead"))
    if job.algorithm.adv_estimator == "gae":
        out += _mini_batch_problems(job.critic, "critic", bsz, n, world // job.derived.critic_sp)
    return out


def _sequence_parallel_problems(job: JobConfig) -> Problems:
    """Ulysses sequence parallelism (docs/sequence_parallel.md): S divides the ranks, the reference
    shares the actor's mesh, and the sequences are packed (S ranks split a packed row)."""
    out: Problems = []
    world, ar = job.derived.world_size, job.actor_rollout_ref
    a_sp, ref_sp = ar.actor.ulysses_sequence_parallel_size, ar.ref.ulysses_sequence_parallel_size
    checks = [(f"{AR}.actor", a_sp, ar.model.use_remove_padding, ar.model.attn_implementation,
               f"{AR}.model")]
    if job.algorithm.adv_estimator == "gae":
        c = job.critic
        checks.append(("critic", c.ulysses_sequence_parallel_size, c.model.use_remove_padding,
                       c.model.attn_implementation, "critic.model"))
    for where, size, packed, attn, model in checks:
        key = f"{where}.ulysses_sequence_parallel_size"
        if size < 1:
            continue  # the section's own rule names it
        if world % size:
            out.append((key, f"{size} does not divide the {world} ranks (trainer.nnodes × trainer.n_gpus_per_node): "
                        "the ranks form (data parallel) × (sequence parallel) groups"))
        if size > 1 and not packed:
            out.append((key, f"{size} splits packed sequences: set {model}.use_remove_padding=true"))
        if size > 1 and attn is not None and attn not in ("sdpa", "eager", "flash_attention_2", "flash_attention_3"):
            out.append((key, f"{size} runs attention through sdpa or flash attention, not {model}.attn_implementation="
                        f"{attn}: set it to sdpa, flash_attention_2 or null"))
    if ref_sp != a_sp and (job.derived.need_ref or ref_sp != 1):
        out.append((f"{AR}.ref.ulysses_sequence_parallel_size", f"{ref_sp} differs from the actor's {a_sp}: the "
                    "reference runs in the actor's workers on the same (data, sequence) mesh; leave it at its default "
                    "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}"))
    return out


def _mini_batch_problems(section: ActorConfig | CriticConfig, where: str, bsz: int, n: int, world: int) -> Problems:
    mini = section.ppo_mini_batch_size
    if mini < 1:
        return []  # the section's own rule names it
    out: Problems = []
    key = f"{where}.ppo_mini_batch_size"
    if mini > bsz or bsz % mini:
        out.append((key, f"{mini} prompts must divide data.train_batch_size={bsz}: pick a divisor of the batch"))
    if mini * n % world:
        return out + [(key, f"ppo_mini_batch_size × rollout.n = {mini} × {n} = {mini * n} trajectories do not split "
                       f"evenly over {world} workers: pick a mini batch whose ×n is a multiple of the worker count")]
    per_worker = mini * n // world
    old = section.ppo_micro_batch_size
    if old is not None and (old < world or old % world):
        return out + [(f"{where}.ppo_micro_batch_size", f"(deprecated, global) must be a multiple of the {world} "
                       "workers; better set ppo_micro_batch_size_per_gpu instead")]
    micro = old // world if old is not None else section.ppo_micro_batch_size_per_gpu
    if micro >= 1 and not section.use_dynamic_bsz and per_worker % micro:
        out.append((f"{where}.ppo_micro_batch_size_per_gpu", f"{micro} does not divide the {per_worker} trajectories "
                    f"each worker gets per mini batch (ppo_mini_batch_size × n ÷ workers = {mini} × {n} ÷ {world}): "
                    "pick a divisor, or set use_dynamic_bsz=true"))
    return out


# ------------------------------------------------------------------------------------------------
# keys accepted for verl compatibility that no code reads yet
# ------------------------------------------------------------------------------------------------
NOT_IMPLEMENTED: dict[str, str] = {
    "data.return_raw_input_ids": "the raw prompt ids are not kept; the rollout reads the chat messages",
    "data.dataloader_num_workers": "batches are collated in the driver (no torch DataLoader workers)",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "FSDP2 shards over all ranks (1-D mesh); HSDP is not implemented",
    "critic.model.fsdp_config.fsdp_size": "FSDP2 shards over all ranks (1-D mesh); HSDP is not implemented",
    "actor_rollout_ref.rollout.ignore_eos": "generation always stops at EOS",
    "actor_rollout_ref.rollout.do_sample": "training rollouts always sample; greedy is for validation (val_kwargs.do_sample)",
    "reward_model.launch_reward_fn_async": "rewards are scored in the driver, in parallel processes (reward_model.num_workers)",
    "trainer.max_critic_ckpt_to_keep": "checkpoints are kept or dropped per step folder: use trainer.max_actor_ckpt_to_keep",
    "trainer.default_hdfs_dir": "no HDFS copy is made; checkpoints go to trainer.default_local_dir",
}
"""key → why it has no effect yet and what to use instead. A non-default value is rejected."""

TYPE_IS_THE_RULE: dict[str, str] = {
    "actor_rollout_ref.hybrid_engine": "only true: the colocated engine is the only one implemented",
    "actor_rollout_ref.rollout.multi_turn.enable": "only true (or the seeds' unset value): the rollout is always "
                                                   "the multi-turn tool loop",
    "reward_model.enable": "only false: rewards are rule-based scorers",
    "actor_rollout_ref.actor.strategy": "fsdp and fsdp2 both name FSDP2, the only strategy",
    "critic.strategy": "fsdp and fsdp2 both name FSDP2, the only strategy",
}
"""verl keys whose Literal type admits only values of one meaning: the type is the whole rule, and no
code needs to read them (a refused value fails with the field's hint)."""


def _lookup(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def not_implemented_problems(cfg: JobConfig) -> list[tuple[str, str]]:
    """(key, message) for every NOT_IMPLEMENTED key set to something other than its default."""
    default = JobConfig()
    problems = []
    for key, why in NOT_IMPLEMENTED.items():
        value, want = _lookup(cfg, key), _lookup(default, key)
        if value != want:
            problems.append((key, f"is not implemented ({why}): remove the override, or set it back to {want!r}"))
    return problems
