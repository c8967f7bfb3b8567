"""Fuzzing validate_config: a valid cpu_tiny config with one (or several) keys set to fuzzed values.

Properties: a value that is bad for its key raises ConfigError naming that key; *any* YAML-shaped
value (scalars, lists, maps, ???, broken interpolations, NaN) either validates or raises
ConfigError, never another exception type. Extends tests/trainer/test_config.py (one hand-picked
bad value per rule).
"""
import copy
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, reject
from hypothesis import strategies as st
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rel_helpers import fuzz

from verl_arpo.trainer.config import LOGGER_BACKENDS, ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]
AR = "actor_rollout_ref"

INT_GE1 = [f"{AR}.rollout.n", f"{AR}.rollout.beam_size", f"{AR}.rollout.entropy_window", f"{AR}.rollout.entropy_topk",
           f"{AR}.rollout.initial_entropy_tokens", f"{AR}.rollout.val_kwargs.n", "trainer.nnodes",
           "trainer.n_gpus_per_node", "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
           f"{AR}.actor.ppo_mini_batch_size", f"{AR}.actor.ppo_micro_batch_size_per_gpu", f"{AR}.actor.ppo_epochs",
           f"{AR}.rollout.log_prob_micro_batch_size_per_gpu", f"{AR}.ref.log_prob_micro_batch_size_per_gpu"]
NULL_OR_INT_GE1 = ["trainer.total_training_steps", "ray_init.num_cpus", f"{AR}.rollout.initial_rollouts"]
INT_ANY = ["trainer.save_freq", "trainer.test_freq", "trainer.total_epochs"]
CHOICES = {f"{AR}.rollout.name": ["hf", "vllm"], f"{AR}.rollout.mode": ["sync_with_tool", "async_with_tool"],
           f"{AR}.rollout.entropy_mode": ["topk_proxy", "full"], "data.truncation": ["error", "left", "right"],
           "trainer.device": ["auto", "cuda", "cpu"], "trainer.resume_mode": ["auto", "disable", "resume_path"],
           f"{AR}.actor.optim.warmup_style": ["constant", "cosine"], f"{AR}.actor.strategy": ["fsdp", "fsdp2"],
           "algorithm.kl_ctrl.type": ["fixed", "adaptive"], "algorithm.kl_penalty": [], f"{AR}.actor.kl_loss_type": [],
           f"{AR}.actor.loss_agg_mode": [], f"{AR}.actor.policy_loss.loss_mode": [], "algorithm.adv_estimator": []}
NAME_LIKE = re.compile(r"^[a-z0-9_\-]+$")  # never the name of a registered estimator/loss (those are below)
KNOWN_NAMES = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "token-mean", "seq-mean-token-sum",
               "seq-mean-token-mean", "seq-mean-token-sum-norm", "vanilla", "grpo", "gae", "rloo",
               "reinforce_plus_plus",
               "remax", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline", "clip_cov", "kl_cov", "gspo"}
FLOATS = {f"{AR}.rollout.branch_probability": (0.0, 1.0), f"{AR}.actor.clip_ratio": (0.0, None),
          f"{AR}.actor.optim.lr": (0.0, None), f"{AR}.actor.clip_ratio_c": (1.0, None)}
FILES = ["data.train_files", f"{AR}.model.path"]

# text a command line can set (Hydra rejects an unparsable "${" before validation runs)
text = st.text(max_size=10).filter(lambda s: "${" not in s)
not_an_int_text = text.filter(lambda s: not re.fullmatch(r"[+-]?\d+", s.strip()))
unresolvable = st.sampled_from(["???", "${no.such.key}", "${data.no_such_leaf}", "${oc.env:NO_SUCH_VAR_FOR_SURE}"])
containers = st.one_of(st.lists(st.integers(), max_size=3),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
nonempty_containers = st.one_of(st.lists(st.integers(), min_size=1, max_size=3),
                                st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2))
yaml_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), text,
              unresolvable),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=5)


def bad_int(minimum):
    return st.one_of(st.integers(max_value=minimum - 1), not_an_int_text, st.booleans(), containers, unresolvable,
                     st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not f.is_integer()
                                                                           if math.isfinite(f) else True))


def bad_choice(allowed):
    names = text.filter(lambda s: s not in allowed and s not in KNOWN_NAMES)
    return st.one_of(names, st.integers(), st.booleans(), containers, unresolvable, st.floats(allow_nan=True))


def bad_float(low, high):
    below = st.floats(max_value=low, allow_nan=False)
    out = [below, st.just(float("nan")), not_an_int_text.filter(lambda s: _float_or_none(s) is None), containers,
           unresolvable, st.booleans()]
    if high is not None:
        out.append(st.floats(min_value=high, exclude_min=True, allow_nan=False))
    return st.one_of(*out)


def _float_or_none(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


@st.composite
def bad_setting(draw):
    """(key, a value that is wrong for it)."""
    kind = draw(st.sampled_from(["int", "null_int", "int_any", "choice", "float", "file", "logger", "bool"]))
    if kind == "int":
        return draw(st.sampled_from(INT_GE1)), draw(bad_int(1))
    if kind == "null_int":
        return draw(st.sampled_from(NULL_OR_INT_GE1)), draw(bad_int(1))
    if kind == "int_any":
        return draw(st.sampled_from(INT_ANY)), draw(st.one_of(not_an_int_text, containers, unresolvable, st.booleans()))
    if kind == "choice":
        key = draw(st.sampled_from(sorted(CHOICES)))
        return key, draw(bad_choice(CHOICES[key]))
    if kind == "float":
        key = draw(st.sampled_from(sorted(FLOATS)))
        return key, draw(bad_float(*FLOATS[key]))
    if kind == "file":
        return draw(st.sampled_from(FILES)), draw(st.one_of(st.just("/no/such/place"), st.integers(),
                                                              nonempty_containers, st.just(""), unresolvable))
    if kind == "logger":
        names = text.filter(lambda s: s.strip().strip("'\"[]") and s.strip() not in LOGGER_BACKENDS
                                                        and "," not in s)
        return "trainer.logger", draw(st.one_of(st.lists(names, min_size=1, max_size=3), names, st.integers()))
    return draw(st.sampled_from([f"{AR}.hybrid_engine", f"{AR}.rollout.multi_turn.enable"])), draw(
        st.one_of(not_an_int_text.filter(bool), st.integers(2, 9), nonempty_containers))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from hydra import compose, initialize_config_dir

    d = tmp_path_factory.mktemp("cfg")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text("{}")
    for name in ("train.parquet", "valid.parquet"):
        (d / name).write_bytes(b"")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=[f"{AR}.model.path={d / 'model'}",
                                                         f"data.train_files={d / 'train.parquet'}",
                                                         f"data.val_files={d / 'valid.parquet'}"])
    validate_config(cfg)
    OmegaConf.set_struct(cfg, False)
    return cfg


def _with(cfg, settings):
    cfg = copy.deepcopy(cfg)
    for key, value in settings:
        try:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        except (OmegaConfBaseException, TypeError, ValueError):  # a key under a section made a list earlier
            reject()
    return cfg


@fuzz(100)
@given(setting=bad_setting())
def test_a_bad_value_raises_config_error_naming_its_key(good, setting):
    key, value = setting
    cfg = _with(good, [setting])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    keys = [k for k, _ in info.value.problems]
    assert key in keys, (key, value, info.value.problems)
    assert key in str(info.value)


KEYS = INT_GE1 + NULL_OR_INT_GE1 + INT_ANY + sorted(CHOICES) + sorted(FLOATS) + FILES + [
    "trainer.logger", f"{AR}.hybrid_engine", f"{AR}.rollout.multi_turn.enable", f"{AR}.model.lora_rank",
    f"{AR}.actor.clip_ratio_low", f"{AR}.actor.clip_ratio_high", f"{AR}.actor.grad_clip", f"{AR}.actor.max_grad_norm",
    "data.val_files", "custom_reward_function.path", "custom_reward_function.name", "reward_model.enable", "critic",
    f"{AR}.actor.use_dynamic_bsz", f"{AR}.actor.ppo_max_token_len_per_gpu", f"{AR}.actor.ppo_micro_batch_size",
    f"{AR}.rollout.log_prob_micro_batch_size", "trainer.resume_from_path",
    "trainer", "data", AR, f"{AR}.rollout", "algorithm"]


@fuzz(100)
@given(settings=st.lists(st.tuples(st.sampled_from(KEYS), yaml_value), min_size=1, max_size=4))
def test_any_value_anywhere_is_valid_or_a_config_error(good, settings):
    cfg = _with(good, settings)
    try:
        validate_config(cfg)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(k, str) and isinstance(m, str) for k, m in exc.problems)


REWARD_FILES = [
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    "this is not python (\n",
    "raise RuntimeError('import-time failure')\n",
    "import sys\nsys.exit(3)\n",
    "compute_score = 42\n",
    "import no_such_module_anywhere\n",
    "\xff\xfe not utf-8",
    "",
]


@fuzz(40)
@given(body=st.sampled_from(REWARD_FILES), name=st.one_of(st.sampled_from(["compute_score", "", "nope"]),
                                                          text), suffix=st.sampled_from([".py", ".txt"]))
def test_a_broken_custom_reward_file_is_a_config_error(good, tmp_path_factory, body, name, suffix):
    path = tmp_path_factory.mktemp("reward") / f"reward{suffix}"
    path.write_bytes(body.encode("utf-8", "surrogateescape") if body.isascii() else body.encode("latin-1"))
    cfg = _with(good, [("custom_reward_function.path", str(path)), ("custom_reward_function.name", name)])
    try:
        validate_config(cfg)
    except ConfigError as exc:
        assert any(k.startswith("custom_reward_function.") for k, _ in exc.problems), exc.problems
    else:
        assert body == REWARD_FILES[0] and suffix == ".py" and name in ("compute_score", "")
