"""The trainer config: YAML contract, the seeds' override lists, validate / normalize / mask, the entry point."""
import re
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from verl_arpo.trainer import main_ppo
from verl_arpo.utils.secrets import is_secret_key
from verl_arpo.trainer.config import ConfigError, parse_logger, resolve_device, validate_config

from config_cases import (CONFIGS, ENV, ROOT, SEED_SCRIPTS, compose, good, good_base, paths,  # noqa: F401
                          problems_of, run_main, seed_words, split_cli)


# ------------------------------------------------------------------------------------------- YAML contract
@pytest.mark.parametrize("name", ["ppo_trainer.yaml", "ppo_trainer_dr.yaml", "cpu_tiny.yaml"])
def test_every_yaml_key_with_a_value_has_a_comment(name):
    bad = []
    for no, line in enumerate((CONFIGS / name).read_text().splitlines(), 1):
        m = re.match(r"^\s*([\w.@-]+):(.*)$", line)
        if m and (m.group(2).strip() and not m.group(2).strip().startswith("#") or m.group(1) == "defaults"):
            if " # " not in line and not line.rstrip().endswith("#"):
                bad.append(f"{name}:{no}: {line.strip()}")
    assert not bad, "keys without a trailing comment:\n" + "\n".join(bad)


def test_presets_compose_and_are_valid(good, paths):
    validate_config(good)
    dr = compose("ppo_trainer_dr")
    assert dr.actor_rollout_ref.rollout.tools.tool_instances.search.class_path.endswith("BingSearchTool")
    assert dr.custom_reward_function.path.endswith("deep_research.py")
    assert dr.data.train_batch_size == 64 and dr.actor_rollout_ref.rollout.n == 12


# ------------------------------------------------------------------------------------------- seed scripts
@pytest.mark.parametrize("name", SEED_SCRIPTS + ["doc_snippets"])
def test_seed_overrides_compose_with_cfg_job(name, paths, tmp_path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = seed_words(name, paths)
    proc = run_main(["--cfg", "job", *words], cwd=tmp_path)  # any cwd works
    assert proc.returncode == 0, proc.stderr
    printed = OmegaConf.create(proc.stdout)
    checked = 0
    for override in OverridesParser.create().parse_overrides(split_cli(words)[1]):
        if override.key_or_group.startswith("hydra."):
            continue
        want = override.value()
        if is_secret_key(override.key_or_group.rsplit(".", 1)[-1]) and want not in (None, ""):
            want = "***"  # --cfg job prints credentials masked
        assert OmegaConf.select(printed, override.key_or_group) == want, override.input_line
        checked += 1
    assert checked >= 15 or name == "doc_snippets"


@pytest.mark.parametrize("name", SEED_SCRIPTS)
def test_seed_overrides_pass_validation(name, paths):
    import importlib.util

    config_name, overrides = split_cli(seed_words(name, paths))
    if importlib.util.find_spec("vllm") is None:  # the seeds ask for vLLM (GPU); validate the rest with hf
        overrides = [o.replace("rollout.name=vllm", "rollout.name=hf") for o in overrides]
    cfg = compose(config_name, overrides)
    validate_config(cfg)
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable in ("", True)  # the seeds' unset ${ENABLE_MULTI_TURN}


@pytest.mark.parametrize("args", [
    ["--cfg", "job", "actor_rollout_ref.actor.ppo_mini_batchsize=1"],    # Hydra refuses it: was a traceback
    ["--cfg", "job", "+actor_rollout_ref.actor.ppo_mini_batchsize=1"],   # Hydra adds it: was exit 0, unchecked
    ["+actor_rollout_ref.actor.ppo_mini_batchsize=1", "actor_rollout_ref.model.path=/m"],   # a run
])
def test_an_unknown_key_is_one_line_naming_the_closest_key(tmp_path, args):
    """[issue 33, item 2] Plain or added, with --cfg job or in a run: the same ConfigError line, exit 2,
    no traceback, and the valid key it was probably meant to be."""
    proc = run_main(args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert ("actor_rollout_ref.actor.ppo_mini_batchsize: unknown key; did you mean "
            "actor_rollout_ref.actor.ppo_mini_batch_size?") in proc.stderr


def test_tool_yaml_can_be_merged_as_a_group():
    cfg = compose("ppo_trainer", ["+tools@actor_rollout_ref.rollout=python_bing"])
    assert cfg.actor_rollout_ref.rollout.tools.tool_instances.search.class_path.endswith("BingSearchTool")


@pytest.mark.parametrize("script,aepo", [("ARPO_7B_Reasoning_1node", False), ("ARPO_14B_DeepSearch_1node", False),
                                         ("AEPO_Qwen3_14B_DeepResearch", True), ("AEPO_Qwen25_7B_DeepResearch", True)])
def test_launch_scripts_compose(script, aepo, paths, tmp_path):
    env = {**ENV, "ACTOR_MODEL_PATH": str(paths / "model"), "SAVE_PATH": str(tmp_path / "save"),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / f"{script}.sh"), "--cfg", "job"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = OmegaConf.create(proc.stdout.split("\n", 1)[1])  # after "Switched to parent directory"
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert actor.enable_entropy_balanced_clipping is aepo and actor.enable_entropy_balanced_advantage is aepo
    assert rollout.multi_turn.enable is True
    assert rollout.tools.tool_instances.search.class_path.endswith("BingSearchTool")
    assert cfg.actor_rollout_ref.model.path == str(paths / "model")
    assert (tmp_path / "save" / "run.log").exists()


def test_cpu_tiny_script_composes(paths, tmp_path):
    env = {**ENV, "MODEL_DIR": str(paths / "model"), "WORK_DIR": str(tmp_path / "work"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "cpu_tiny_arpo.sh"), "--cfg", "job"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.trainer.device == "cpu"
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.rollout.n == 4
    assert list(cfg.trainer.logger) == ["console", "jsonl"]


# ------------------------------------------------------------------------------------------- validation rules
RULES = [  # (override, key named in the error)
    ("actor_rollout_ref.rollout.initial_rollouts=8", "actor_rollout_ref.rollout.initial_rollouts"),  # n=4 < 8
    ("trainer.n_gpus_per_node=3", "data.train_batch_size"),  # 2 prompts × n=4 = 8 trajectories over 3 workers
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.model.path=/no/such/model", "actor_rollout_ref.model.path"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.actor.loss_agg_mode=token-sum", "actor_rollout_ref.actor.loss_agg_mode"),
    ("algorithm.adv_estimator=ppo2", "algorithm.adv_estimator"),
    ("actor_rollout_ref.actor.kl_loss_type=k9", "actor_rollout_ref.actor.kl_loss_type"),
    ("actor_rollout_ref.rollout.entropy_mode=renyi", "actor_rollout_ref.rollout.entropy_mode"),
    ("actor_rollout_ref.rollout.branch_rule=beam", "actor_rollout_ref.rollout.branch_rule"),
    ("actor_rollout_ref.rollout.multi_turn.enable=false", "actor_rollout_ref.rollout.multi_turn.enable"),
    ("actor_rollout_ref.rollout.enforce_eager=false", "actor_rollout_ref.rollout.enforce_eager"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("algorithm.rollout_is=true", "algorithm.rollout_is"),
    ("algorithm.rollout_is_mode=mask", "algorithm.rollout_is_mode"),
    ("algorithm.rollout_is_threshold=0", "algorithm.rollout_is_threshold"),
    ("actor_rollout_ref.rollout.calculate_log_probs=false", "actor_rollout_ref.rollout.calculate_log_probs"),  # + TIS
    ("actor_rollout_ref.actor.clip_ratio_c=1.0", "actor_rollout_ref.actor.clip_ratio_c"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=nope", "actor_rollout_ref.actor.policy_loss.loss_mode"),
    ("trainer.logger=[console,mlflow]", "trainer.logger"),
    ("trainer.device=tpu", "trainer.device"),
    ("data.train_files=/no/such.parquet", "data.train_files"),
    ("custom_reward_function.path=/no/such_reward.py", "custom_reward_function.path"),
    ("custom_reward_function.name=no_such_fn", "custom_reward_function.name"),
    ("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.mode"),
    ("actor_rollout_ref.rollout.branch_probability=1.5", "actor_rollout_ref.rollout.branch_probability"),
    ("algorithm.kl_penalty=k9", "algorithm.kl_penalty"),
    ("trainer.resume_mode=resume_path", "trainer.resume_from_path"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    ("actor_rollout_ref.model.use_prefix_sharing=true", "actor_rollout_ref.model.use_prefix_sharing"),  # unpacked
]


@pytest.mark.parametrize("override,key", RULES, ids=[k for _, k in RULES])
def test_each_bad_value_fails_naming_its_key(good, paths, override, key):
    k, _, v = override.partition("=")
    extra = ["actor_rollout_ref.actor.use_dynamic_bsz=true"] if "max_token_len" in k else []
    if k == "custom_reward_function.name":
        extra = [f"custom_reward_function.path={paths / 'reward.py'}"]
    if k.endswith("calculate_log_probs"):   # refused only where TIS needs the engine's log-probs
        extra = ["algorithm.rollout_is_threshold=2.0"]
        validate_config(OmegaConf.merge(good, OmegaConf.from_dotlist([override])))  # alone it is valid
    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist([override, *extra]))
    problems = problems_of(cfg)
    assert key in problems, problems
    assert key in str(ConfigError(list(problems.items())))


def test_prefix_sharing_needs_packing_and_a_tree_mask_backend(good):
    key = "actor_rollout_ref.model.use_prefix_sharing"
    on = ["actor_rollout_ref.model.use_remove_padding=true", f"{key}=true"]
    validate_config(OmegaConf.merge(good, OmegaConf.from_dotlist(on)))
    for attn in ("sdpa", "eager", "flex_attention"):
        validate_config(OmegaConf.merge(good, OmegaConf.from_dotlist(
            [*on, f"actor_rollout_ref.model.attn_implementation={attn}"])))
    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist(
        [*on, "actor_rollout_ref.model.attn_implementation=flash_attention_2"]))
    assert "sdpa, eager or flex_attention" in problems_of(cfg)[key]


def test_missing_model_path_and_gae_without_critic(good):
    cfg = compose("ppo_trainer")  # model.path: ???
    assert "actor_rollout_ref.model.path" in problems_of(cfg)
    cfg = OmegaConf.merge(good, {"algorithm": {"adv_estimator": "gae"}, "critic": {"model": {"path": None}}})
    assert "critic" in problems_of(cfg)


def test_all_problems_are_reported_at_once(good):
    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist(
        ["actor_rollout_ref.rollout.name=x", "algorithm.adv_estimator=y", "actor_rollout_ref.actor.clip_ratio_c=0.5"]))
    with pytest.raises(ConfigError, match=r"3 problem") as info:
        validate_config(cfg)
    assert isinstance(info.value, ValueError)
    assert "accepted: ['hf', 'vllm']" in str(info.value)


def test_run_validates_before_ray(good, monkeypatch):
    started = []
    monkeypatch.setattr(main_ppo, "init_ray", lambda cfg: started.append(cfg))
    monkeypatch.setattr(main_ppo, "load_run_ppo", lambda: started.append("import"))
    bad = OmegaConf.merge(good, {"actor_rollout_ref": {"rollout": {"n": 1}}})  # initial_rollouts=2 > n
    with pytest.raises(ConfigError, match="initial_rollouts"):
        main_ppo.run(bad)
    assert started == []


def test_main_with_a_bad_value_exits_quickly_without_ray(paths, tmp_path):
    t0 = time.monotonic()
    proc = run_main(["--config-name=cpu_tiny", f"actor_rollout_ref.model.path={paths / 'model'}",
                     f"data.train_files={paths / 'train.parquet'}", f"data.val_files={paths / 'valid.parquet'}",
                     "actor_rollout_ref.rollout.initial_rollouts=9",
                     "actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key=sk-NOT-PRINTED"],
                    cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "actor_rollout_ref.rollout.initial_rollouts" in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr and not list(tmp_path.glob("**/ray*"))
    assert "sk-NOT-PRINTED" not in proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------------- derived values
def test_user_keys_keep_their_meaning_and_worker_sizes_are_derived(good):
    """[issue 32, item 2] Nothing rewrites a user key: ppo_mini_batch_size stays in prompts, and what a
    worker runs (trajectories per worker) is a field of JobConfig.derived, computed there alone."""
    from verl_arpo.config import JobConfig

    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist([
        "actor_rollout_ref.actor.max_grad_norm=0.5", "actor_rollout_ref.rollout.log_prob_micro_batch_size=16",
        "trainer.logger=[console, jsonl]", "actor_rollout_ref.rollout.multi_turn.enable="]))
    cfg.trainer.logger = "[console, jsonl]"  # the seeds' string form
    validate_config(cfg)
    before = OmegaConf.to_container(cfg)
    job = JobConfig.from_mapping(cfg)
    assert OmegaConf.to_container(cfg) == before  # not mutated
    actor, d = job.actor_rollout_ref.actor, job.derived
    assert actor.ppo_mini_batch_size == 1 and d.actor_update.mini_batch == 1 * 4 // 2  # prompts × n ÷ workers
    assert actor.grad_clip == 1.0 and actor.max_grad_norm == 0.5 and actor.clip_norm == 0.5  # verl's alias wins
    per_gpu = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    assert job.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == per_gpu != 16 // 2  # untouched
    assert d.actor_log_prob.micro_batch == 16 // 2  # the deprecated global size, per worker
    assert parse_logger(job.trainer.logger) == ["console", "jsonl"]


def test_sequence_parallel_keys_their_rules_and_derived_sizes(good):
    """[issue 35] verl's ulysses_sequence_parallel_size keys: the ranks form dp × sp groups, so S divides
    them, sizes per worker are per data-parallel replica and token budgets per GPU hold S× per micro-batch;
    the reference shares the actor's mesh; a packed row is what S ranks split."""
    from verl_arpo.config import JobConfig

    A = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    on = ["actor_rollout_ref.model.use_remove_padding=true", f"{A}=2", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist(on))
    validate_config(cfg)
    job = JobConfig.from_mapping(cfg)
    d, actor = job.derived, job.actor_rollout_ref.actor
    assert (d.world_size, d.actor_sp, d.critic_sp) == (2, 2, 1)
    assert job.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2  # follows the actor's by interpolation
    n = job.actor_rollout_ref.rollout.n
    assert d.actor_update.mini_batch == actor.ppo_mini_batch_size * n // 1  # one replica of 2 ranks
    assert d.actor_update.max_token_len == 2 * actor.ppo_max_token_len_per_gpu
    assert d.actor_log_prob.max_token_len == 2 * job.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    assert d.ref_log_prob.max_token_len == 2 * job.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu

    def bad(*extra):
        return problems_of(OmegaConf.merge(good, OmegaConf.from_dotlist([*on, *extra])))

    assert "does not divide the 2 ranks" in bad(f"{A}=3")[A]
    assert "must be an integer >= 1" in bad(f"{A}=0")[A]
    assert "use_remove_padding=true" in bad("actor_rollout_ref.model.use_remove_padding=false")[A]
    assert "flash_attention_2" in bad("actor_rollout_ref.model.attn_implementation=flex_attention")[A]
    ref = "actor_rollout_ref.ref.ulysses_sequence_parallel_size"
    assert "the actor's workers" in bad(f"{ref}=1", "actor_rollout_ref.actor.use_kl_loss=true",
                                          "actor_rollout_ref.actor.kl_loss_coef=0.1")[ref]
    C = "critic.ulysses_sequence_parallel_size"
    gae = ["algorithm.adv_estimator=gae", f"critic.model.path={good.actor_rollout_ref.model.path}", f"{C}=2"]
    assert "critic.model.use_remove_padding=true" in bad(*gae)[C]
    validate_config(OmegaConf.merge(good, OmegaConf.from_dotlist([*on, *gae, "critic.model.use_remove_padding=true"])))


@pytest.mark.parametrize("use_kl_loss,kl_loss_coef,in_reward,kl_coef,want_loss,want_reward", [
    (True, 0.0, False, 0.001, False, False),   # the seeds' scripts: KL loss switched on with weight 0
    (True, 0.01, False, 0.001, True, False),
    (False, 0.01, True, 0.0, False, False),    # in-reward KL with β = 0 is off too
    (False, 0.0, True, 0.002, False, True),
])
def test_whether_a_kl_term_is_active_is_derived_once(good, use_kl_loss, kl_loss_coef, in_reward, kl_coef,
                                                      want_loss, want_reward):
    """[issue 15, 32] The trainer (reference forward), the workers (reference model) and the actor (KL
    loss) all read these two derived flags; the user's keys stay as given."""
    from verl_arpo.config import JobConfig

    cfg = OmegaConf.merge(good, OmegaConf.from_dotlist([
        f"actor_rollout_ref.actor.use_kl_loss={use_kl_loss}", f"actor_rollout_ref.actor.kl_loss_coef={kl_loss_coef}",
        f"algorithm.use_kl_in_reward={in_reward}", f"algorithm.kl_ctrl.kl_coef={kl_coef}"]))
    job = JobConfig.from_mapping(cfg)
    assert job.derived.kl_loss_active is want_loss and job.derived.kl_in_reward_active is want_reward
    assert job.actor_rollout_ref.actor.use_kl_loss is use_kl_loss


def test_parse_logger_and_resolve_device():
    assert parse_logger("[console, wandb]") == ["console", "wandb"] == parse_logger("console,wandb")
    assert parse_logger(["jsonl"]) == ["jsonl"]
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="trainer.device"):
            resolve_device("cuda")
    assert resolve_device("auto", gpus=1) == "cuda" and resolve_device("auto", gpus=0) == "cpu"
    with pytest.raises(ConfigError, match="neither the Ray cluster"):
        resolve_device("cuda", gpus=0)


def test_auto_device_follows_the_ray_cluster_not_the_driver():
    """[issue 17, item 9] A driver without CUDA on a cluster with GPUs must give GPU workers: once Ray is
    up, auto resolves from the cluster's GPU resources (here a local cluster that declares one GPU)."""
    code = ("import ray; ray.init(num_cpus=1, num_gpus=1, include_dashboard=False); "
            "from verl_arpo.trainer.config import cluster_gpus, resolve_device; "
            "print(cluster_gpus(), resolve_device('auto')); ray.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "cuda"]


def test_the_readme_shows_the_real_config_error_format():
    err = str(ConfigError([("trainer.logger", "bad"), ("data.train_files", "missing")]))
    assert err.startswith("invalid config (2 problem(s)):\n  - trainer.logger: bad\n  - data.train_files: missing")
    readme = (ROOT / "README.md").read_text()
    assert "`[verl_arpo] invalid config (N problem(s)):` followed by one `  - <key>:" in readme


def test_verl_keys_users_carry_over_are_accepted():
    """Keys of current verl that used to fail with "Key not in struct"."""
    from verl_arpo.config import JobConfig

    cfg = compose("cpu_tiny", ("actor_rollout_ref.model.path=/m", "trainer.val_only=true",
                               "+data.apply_chat_template_kwargs.enable_thinking=false",
                               "data.custom_chat_template='{{ messages[0].content }}'"))
    job = JobConfig.from_mapping(OmegaConf.to_container(cfg, resolve=True))
    assert job.trainer.val_only is True
    assert job.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert job.data.custom_chat_template == "{{ messages[0].content }}"


@pytest.mark.parametrize("logger_name", ["mlflow", "swanlab"])
def test_verl_loggers_we_do_not_ship_are_rejected_with_what_to_use(good, logger_name):
    bad = OmegaConf.merge(good, {"trainer": {"logger": ["console", logger_name]}})
    with pytest.raises(ConfigError, match=rf"\['{logger_name}'\] are verl loggers .* use wandb or tensorboard"):
        validate_config(bad)


def test_a_configured_logger_that_is_not_installed_is_a_config_error(good, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    bad = OmegaConf.merge(good, {"trainer": {"logger": ["console", "wandb"]}})
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install 'verl_arpo\[wandb\]'"):
        validate_config(bad)


# ------------------------------------------------------------------------------------------- Ray start-up
class FakeRay:
    def __init__(self):
        self.calls = []

    def is_initialized(self):
        return bool(self.calls)

    def init(self, **kwargs):
        self.calls.append(kwargs)


def test_init_ray_local_and_join(good, monkeypatch):  # a fake ray module: starting Ray here costs ~10 s
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    cfg = compose("cpu_tiny", ["+ray_init.runtime_env.env_vars.MY_VAR=1",
                               "+ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=true"])
    from verl_arpo.config import JobConfig

    job = JobConfig.from_mapping(cfg)
    assert main_ppo.init_ray(job) is True and main_ppo.init_ray(job) is False  # second call: already up
    (kwargs,) = fake.calls
    assert kwargs["num_cpus"] == 2 and kwargs["include_dashboard"] is False
    assert kwargs["runtime_env"]["env_vars"] == {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "true",
                                                 "MY_VAR": "1"}
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    main_ppo.init_ray(JobConfig.from_mapping(OmegaConf.merge(good, {"ray_init": {"address": "auto"}})))
    assert fake.calls[0]["address"] == "auto" and "num_cpus" not in fake.calls[0]


def test_cpu_workers_split_their_nodes_cores():
    """1 worker on 2 cores computes with 2 threads; 2 workers get 1 each; never 0."""
    from verl_arpo.trainer.ppo.ray_trainer import cpu_threads_per_worker

    assert [cpu_threads_per_worker(c, w) for c, w in ((2, 1), (2, 2), (8, 3), (1, 4), (16, 8))] == [2, 1, 2, 1, 2]


def test_the_console_gets_a_summary_and_the_full_config_goes_to_a_file(paths, tmp_path):
    """No 300-line YAML dump on the console: a few summary lines ending with the config file's path,
    and that file holds the whole (masked) config."""
    proc = run_main(["--config-name=cpu_tiny", f"actor_rollout_ref.model.path={paths / 'model'}",
                     "actor_rollout_ref.actor.optim.lr=-1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2  # the bad lr: stops before Ray, after the summary
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("[verl_arpo] ")]
    assert [ln.split()[1] for ln in summary] == ["model", "algorithm", "rollout", "data", "run", "output", "config"]
    assert "actor_rollout_ref:" not in proc.stdout  # no YAML dump
    full = tmp_path / "run" / "config.yaml"
    assert summary[-1] == f"[verl_arpo] config    {full}"
    assert OmegaConf.create(full.read_text()).actor_rollout_ref.actor.optim.lr == -1
