"""The typed config (verl_arpo.config): the YAML and the dataclasses agree key by key and
default by default, every preset builds, unknown keys are named, every key is read by some code,
and keys no code reads yet refuse a non-default value."""
import dataclasses
import re
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import verl_arpo.config as jc

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
FREE_FORM = {"override_config", "tool_instances", "runtime_env", "reward_kwargs",
             "apply_chat_template_kwargs"}
"""dict-valued keys whose contents belong to another component (HF config, tools, Ray, the user's scorer,
the chat template)."""
INTERPOLATED = {"actor_rollout_ref.model.path", "critic.model.path", "critic.model.tokenizer_path"}
"""required (???) or interpolated to a required key: no default to compare."""


def _compose(name, *overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(name, overrides=["actor_rollout_ref.model.path=/m", *overrides])


def _leaves(node, prefix=""):
    """(dotted key, value) of every leaf of a plain nested dict, free-form dicts as leaves."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in FREE_FORM:
            yield from _leaves(v, key + ".")
        else:
            yield key, v


def _fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], key + ".")
        else:
            yield key


def _get(obj, key):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _same(a, b):
    norm = (lambda x: list(x) if isinstance(x, (list, tuple)) else x)
    return norm(a) == norm(b)


def test_yaml_and_dataclasses_agree_on_every_key_and_default():
    raw = OmegaConf.to_container(_compose("ppo_trainer"), resolve=True)
    yaml_keys = dict(_leaves(raw))
    field_keys = set(_fields(jc.JobConfig))
    assert set(yaml_keys) == field_keys, (sorted(set(yaml_keys) - field_keys), sorted(field_keys - set(yaml_keys)))
    default = jc.JobConfig()
    wrong = {k: (v, _get(default, k)) for k, v in yaml_keys.items()
             if k not in INTERPOLATED and not _same(v, _get(default, k))}
    assert not wrong, wrong  # key: (YAML default, dataclass default)


@pytest.mark.parametrize("preset", ["ppo_trainer", "ppo_trainer_dr", "cpu_tiny", "quickstart"])
def test_every_preset_builds_and_its_values_arrive(preset):
    cfg = _compose(preset, "trainer.device=cpu")
    job = jc.JobConfig.from_mapping(cfg)
    assert job.actor_rollout_ref.actor.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert job.actor_rollout_ref.actor.optim.lr == float(cfg.actor_rollout_ref.actor.optim.lr)
    assert isinstance(job.actor_rollout_ref.actor.optim.lr, float)  # YAML reads 1e-6 as a string
    d = job.derived
    assert d.world_size == cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    n, world = cfg.actor_rollout_ref.rollout.n, d.world_size   # a plain reference for the per-worker sizes
    assert d.actor_update.mini_batch == cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n // world
    assert d.actor_update.micro_batch == cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    assert d.critic_update.mini_batch == cfg.critic.ppo_mini_batch_size * n // world
    assert d.ref_log_prob.max_token_len == cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
    assert d.need_ref is False and d.need_critic is False  # no preset trains with KL or GAE
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.trainer.seed = 3


@pytest.mark.parametrize("overrides,want", [
    ([], dict(kl_loss_active=False, need_ref=False, on_policy=False)),  # cpu_tiny: 2 mini-batches per step
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], dict(on_policy=True)),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_epochs=2"], dict(on_policy=False)),
    (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0"],
     dict(kl_loss_active=False, need_ref=False)),
    (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1"],
     dict(kl_loss_active=True, need_ref=True)),
    (["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.ppo_mini_batch_size=2"],
     dict(kl_in_reward_active=True, need_ref=True, on_policy=False)),
    (["algorithm.adv_estimator=gae"], dict(need_critic=True)),
])
def test_derived_values(overrides, want):
    job = jc.JobConfig.from_mapping(_compose("cpu_tiny", *overrides))
    got = {k: getattr(job.derived, k) for k in want}
    assert got == want


def test_unknown_and_mistyped_keys_are_named():
    with pytest.raises(jc.ConfigError, match=r"actor_rollout_ref\.actor\.ppo_mini_batchsize: unknown key"):
        jc.JobConfig.from_mapping({"actor_rollout_ref": {"actor": {"ppo_mini_batchsize": 4}}})
    with pytest.raises(jc.ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr: must be a number"):
        jc.JobConfig.from_mapping({"actor_rollout_ref": {"actor": {"optim": {"lr": "fast"}}}})
    with pytest.raises(jc.ConfigError, match=r"critic: must be a section"):
        jc.JobConfig.from_mapping({"critic": 3})


def test_every_key_is_read_by_some_code():
    """A key no code reads would be accepted and ignored: each field name must appear as an attribute
    read (`.name`) or a quoted key somewhere in verl_arpo/ outside the config definitions — or be
    listed in NOT_IMPLEMENTED, where a non-default value is an error, or in TYPE_IS_THE_RULE, where the
    type admits only values of one meaning. A check in a section's problems() is not a reader: a key
    that is only checked would still be ignored."""
    import inspect

    definitions = ROOT / "verl_arpo" / "utils" / "job_config"
    sources = "\n".join(p.read_text() for p in (ROOT / "verl_arpo").rglob("*.py") if definitions not in p.parents)
    sources += "".join(inspect.getsource(reader) for reader in (  # the readers among the definitions
        jc.JobConfig.derived.func, jc.Batching, jc.ActorConfig.clip_norm.fget, jc.TrainerConfig.loggers.fget))
    unread = []
    for key in _fields(jc.JobConfig):
        leaf = key.rsplit(".", 1)[-1]
        if key in jc.NOT_IMPLEMENTED:
            continue
        if key in jc.TYPE_IS_THE_RULE:
            leaf_type = typing.get_type_hints(type(_get(jc.JobConfig(), key.rsplit(".", 1)[0]))
                                              if "." in key else jc.JobConfig)[leaf]
            assert jc.choices(leaf_type), (key, "TYPE_IS_THE_RULE holds Literal-typed keys only")
            continue
        if not re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", sources):
            unread.append(key)
    assert not unread, unread


def test_not_implemented_keys_reject_a_non_default_value():
    job = jc.JobConfig.from_mapping({"actor_rollout_ref": {"rollout": {"ignore_eos": True}},
                                     "trainer": {"max_critic_ckpt_to_keep": 3}})
    problems = dict(jc.not_implemented_problems(job))
    assert set(problems) == {"actor_rollout_ref.rollout.ignore_eos", "trainer.max_critic_ckpt_to_keep"}
    assert "set it back to False" in problems["actor_rollout_ref.rollout.ignore_eos"]
    assert jc.not_implemented_problems(jc.JobConfig()) == []
    for key in jc.NOT_IMPLEMENTED:  # every listed key exists
        _get(jc.JobConfig(), key)


def test_the_yaml_comment_of_every_refused_key_says_so():
    """[issue 33, item 4] A key validation refuses is described as refused in the YAML (and so in
    docs/configuration.md), never as working."""
    lines = (ROOT / "configs" / "ppo_trainer.yaml").read_text().splitlines()
    for key in jc.NOT_IMPLEMENTED:
        leaf = key.rsplit(".", 1)[-1]
        comments = [line.split("#", 1)[1] for line in lines if re.match(rf"\s*{leaf}:", line) and "#" in line]
        assert comments and any("refused" in c and "not implemented" in c for c in comments), (key, comments)


# ------------------------------------------------------------------------------------------- types (issue 32)
def _problems(tree):
    from verl_arpo.trainer.config import validate_config   # the config's rules + the registry names

    with pytest.raises(jc.ConfigError) as info:
        validate_config(tree)
    return dict(info.value.problems)


def test_each_value_is_checked_against_its_fields_type():
    """The annotation is the rule (docs/configuration.md, "How a value is checked"): what an
    environment interpolation gives is accepted, what is a different type is named."""
    rollout = "actor_rollout_ref.rollout"
    ok, problems = jc.typed.build(jc.JobConfig, {"actor_rollout_ref": {"rollout": {
        "n": "8", "temperature": "0.5", "calculate_log_probs": "false", "name": "vllm"}},
        "trainer": {"experiment_name": 2024, "logger": "[console, jsonl]"}}, "")
    assert problems == []
    r = ok.actor_rollout_ref.rollout
    assert (r.n, r.temperature, r.calculate_log_probs, r.name) == (8, 0.5, False, "vllm")
    assert ok.trainer.experiment_name == "2024" and ok.trainer.loggers == ["console", "jsonl"]
    _, problems = jc.typed.build(jc.JobConfig, {"actor_rollout_ref": {"rollout": {
        "n": 2.0, "beam_size": True, "temperature": float("nan"), "mode": "async", "seed_requests": "yes",
        "tools": {"call_limit": [3]}}}}, "")
    got = dict(problems)
    assert got == {f"{rollout}.n": "must be an integer, got 2.0",
                   f"{rollout}.beam_size": "must be an integer, got True",
                   f"{rollout}.temperature": "must be a number, got nan",
                   f"{rollout}.mode": "unknown 'async'; accepted: ['sync_with_tool', 'async_with_tool'] "
                                      "(sync: rounds with barriers; async: no barriers)",
                   f"{rollout}.seed_requests": "must be true or false, got 'yes'",
                   f"{rollout}.tools.call_limit": "must be an integer, got [3]"}


def test_a_type_problem_silences_its_sections_rules_but_not_the_others():
    """rollout.n='x' is one message; the rule initial_rollouts <= n would compare with the default
    that replaced it, so the rollout section's rules (and the cross-section ones) wait. The actor's
    and the algorithm's rules still run: every independent problem at once."""
    got = _problems({"actor_rollout_ref": {"model": {"path": "/no/such/model"},
                                           "rollout": {"n": "x", "initial_rollouts": 2},
                                           "actor": {"clip_ratio_c": 0.5}},
                     "algorithm": {"adv_estimator": "ppo2"}})
    assert set(got) == {"actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.clip_ratio_c",
                        "algorithm.adv_estimator", "actor_rollout_ref.model.path"}, got
    # the config package alone knows no registry (it sits below the algorithms): the root adds the names
    with pytest.raises(jc.ConfigError) as info:
        jc.JobConfig.checked({"actor_rollout_ref": {"model": {"path": "/no/such/model"}},
                              "algorithm": {"adv_estimator": "ppo2"}})
    assert "algorithm.adv_estimator" not in dict(info.value.problems)
    # the same tree with a good n: the rollout and cross-section rules run again
    got = _problems({"actor_rollout_ref": {"model": {"path": "/no/such/model"}, "rollout": {"n": 1, "initial_rollouts": 2}}})
    assert "actor_rollout_ref.rollout.initial_rollouts" in got and "larger than rollout.n=1" in \
        got["actor_rollout_ref.rollout.initial_rollouts"]


def test_unresolved_interpolations_and_missing_values_are_named():
    tree = OmegaConf.create({"data": {"train_batch_size": "${no.such.key}"},
                             "actor_rollout_ref": {"model": {"path": "???"}},
                             "critic": {"model": {"path": "${actor_rollout_ref.model.path}"}}})
    got = _problems(tree)
    assert got["data.train_batch_size"].startswith("does not resolve (")
    assert got["actor_rollout_ref.model.path"].startswith("is required")
    assert "critic.model.path" not in got  # an interpolation to ??? is "not given", and no critic is built


def test_choice_lists_come_from_the_configs_literals():
    """One list of accepted names: the modules that act on a choice take it from the config's type."""
    from verl_arpo.algos import branching, core_algos, rollout_mismatch
    from verl_arpo.workers.rollout.engines import base

    hints = typing.get_type_hints
    assert core_algos.LOSS_AGG_MODES == typing.get_args(hints(jc.ActorConfig)["loss_agg_mode"])
    assert core_algos.KL_PENALTIES == typing.get_args(hints(jc.ActorConfig)["kl_loss_type"])
    assert branching.ENTROPY_MODES == typing.get_args(hints(jc.RolloutSection)["entropy_mode"])
    assert base.ENGINE_NAMES == jc.ROLLOUT_NAMES == typing.get_args(hints(jc.RolloutSection)["name"])
    assert rollout_mismatch.ROLLOUT_IS_MODES == typing.get_args(hints(jc.AlgorithmConfig)["rollout_is_mode"])


def test_components_take_typed_sections_only():
    """No component re-builds a config from a mapping (issue 32, goal 3): a dict is a TypeError naming
    validate_config, not a second, looser reading of the same keys."""
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo
    from verl_arpo.workers.reward_manager import load_reward_manager

    for call in (lambda: run_ppo({"trainer": {}}), lambda: load_reward_manager({}, None)):
        with pytest.raises(TypeError, match="validate_config"):
            call()


def test_optim_eps_reaches_adamw_and_must_be_positive():
    """The key added as the example of issue 32, goal 5: the YAML, OptimConfig (its rule) and the
    code that reads it; nothing else holds its default."""
    import torch

    from verl_arpo.workers.optim_step import build_adamw

    job = jc.JobConfig.from_mapping({"actor_rollout_ref": {"actor": {"optim": {"eps": "1e-6"}}}})
    opt = build_adamw([torch.nn.Parameter(torch.zeros(2))], job.actor_rollout_ref.actor.optim)
    assert opt.param_groups[0]["eps"] == 1e-6
    assert build_adamw([torch.nn.Parameter(torch.zeros(2))], jc.OptimConfig()).param_groups[0]["eps"] == 1e-8
    assert "actor_rollout_ref.actor.optim.eps" in _problems({"actor_rollout_ref": {"actor": {"optim": {"eps": 0}}}})


def test_ray_env_vars_are_checked_and_split_once():
    """ray_init.runtime_env.env_vars: every value a string, number or bool (named when not); the
    split into what Ray may log and the credentials is computed once, from the defaults and the user's."""
    found = _problems({"ray_init": {"runtime_env": {"env_vars": {"OK": 1, "BAD": [1, 2], "NONE": None},
                                                    "working_dir": "."}}})
    env_keys = {k for k in found if k.startswith("ray_init.")}
    assert env_keys == {"ray_init.runtime_env.env_vars.BAD", "ray_init.runtime_env.env_vars.NONE"}
    assert "got list" in found["ray_init.runtime_env.env_vars.BAD"]
    ray = jc.RayInitConfig(runtime_env={"env_vars": {"WANDB_API_KEY": "s3cret", "FLAG": True, "TOKENIZERS_PARALLELISM": "true"}})
    public, secrets = ray.worker_env
    assert secrets == {"WANDB_API_KEY": "s3cret"}
    assert public == {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "true", "FLAG": "true"}
    assert ray.worker_env is ray.worker_env   # computed once
