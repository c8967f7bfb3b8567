"""The trainer config's secrets: masked in every printed, logged and saved form (utils/secrets.py)."""
import pytest
from omegaconf import OmegaConf

from verl_arpo.trainer import main_ppo
from verl_arpo.trainer.config import mask_secrets
from verl_arpo.utils.secrets import is_secret_key
from config_cases import ROOT, compose, good, good_base, paths, run_main  # noqa: F401  (fixtures: good needs the other two)


# ------------------------------------------------------------------------------------------- secrets
def test_mask_secrets_nested(monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "bd-env-value-123")
    params = {"api_key": "sk-1", "zone": "z", "API_KEY": "x", "url": "u?k=bd-env-value-123"}
    cfg = {"tools": {"search": {"params": params}},
           "hub": {"hf_token": "hf_x", "HF_TOKEN": "hf_y", "tokenizer": "tok/path", "ppo_max_token_len_per_gpu": 5},
           "db": [{"password": "pw", "client_secret": "cs"}], "empty": {"api_key": None},
           "ray": {"runtime_env": {"env_vars": {"WANDB_API_KEY": "wk", "OTHER": "1"}}}}
    out = mask_secrets(OmegaConf.create(cfg))
    assert isinstance(out, dict)
    p = out["tools"]["search"]["params"]
    assert p["api_key"] == p["API_KEY"] == "***" and p["zone"] == "z" and p["url"] == "u?k=***"
    assert out["hub"] == {"hf_token": "***", "HF_TOKEN": "***", "tokenizer": "tok/path", "ppo_max_token_len_per_gpu": 5}
    assert out["db"] == [{"password": "***", "client_secret": "***"}]
    assert out["empty"]["api_key"] is None
    assert out["ray"]["runtime_env"]["env_vars"] == {"WANDB_API_KEY": "***", "OTHER": "1"}
    assert cfg["tools"]["search"]["params"]["api_key"] == "sk-1"  # input untouched
    assert mask_secrets(compose("ppo_trainer"))["actor_rollout_ref"]["model"]["path"] == "???"


def test_secret_names_and_headers_beyond_api_key(monkeypatch):
    """Credential names other than *api_key* (subscription keys, Authorization headers, cookies) and
    the values of any credential-named environment variable are masked; look-alikes are not."""
    from verl_arpo.utils.secrets import is_secret_key, mask_text

    secret = ["subscription_key", "Ocp-Apim-Subscription-Key", "Authorization", "proxy_authorization",
              "auth_header", "access_key", "AWS_SECRET_ACCESS_KEY", "private_key", "cookie", "session_key",
              "WANDB_API_KEY", "HF_TOKEN", "MY_SERVICE_TOKEN"]
    plain = ["author", "authority", "prompt_key", "reward_fn_key", "response_key", "tokenizer",
             "ppo_max_token_len_per_gpu", "max_tokens", "key", "zone"]
    assert [k for k in secret if not is_secret_key(k)] == []
    assert [k for k in plain if is_secret_key(k)] == []
    monkeypatch.setenv("MY_SERVICE_TOKEN", "svc-value-9876")  # a name only the rule knows
    monkeypatch.setenv("OTHER_SETTING", "visible-value")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # Ray exports it: a setting, not a secret
    assert mask_text("rollout/tokens_generated") == "rollout/tokens_generated"
    text = ('GET /?t=svc-value-9876 {"Authorization": "Bearer sk-live-42"} authorization=abc123 '
            "Proxy-Authorization: Basic dXNlcjpwdw== bearer tok_77; other=visible-value")
    out = mask_text(text)
    for leaked in ("svc-value-9876", "sk-live-42", "abc123", "dXNlcjpwdw==", "tok_77"):
        assert leaked not in out, (leaked, out)
    assert out.count("***") == 5 and "visible-value" in out and '"Authorization": "Bearer ***"' in out


def test_hyphenated_headers_key_suffixes_and_url_passwords_are_masked():
    """[issue 33, item 1] Names beyond *api_key* and free-text forms: `x-api-key` headers, `*_key`
    names (not data columns), a URL's password, and credential keys written as YAML or JSON."""
    from verl_arpo.utils.secrets import is_secret_key, mask_text

    assert all(is_secret_key(k) for k in ("x-api-key", "X-Api-Key", "openai_key", "serper-key", "bing_key"))
    assert not any(is_secret_key(k) for k in ("prompt_key", "reward_fn_key", "response_key", "key", "monkey"))
    text = ('GET https://bob:hunter2pass@search.example/q?x=1 http://example.com:8080/a\n'
            'X-Api-Key: k-header-55 {"x-api-key": "k-json-66", "model": "m"}\n'
            'params:\n  openai_key: k-yaml-77\n  prompt_key: prompt\n  api_key: null\n')
    out = mask_text(text)
    for leaked in ("hunter2pass", "k-header-55", "k-json-66", "k-yaml-77"):
        assert leaked not in out, (leaked, out)
    assert "https://bob:***@search.example/q" in out and "http://example.com:8080/a" in out
    assert "prompt_key: prompt" in out and "api_key: null" in out and '"model": "m"' in out


def test_saved_config_is_masked(good, tmp_path):
    cfg = OmegaConf.merge(good, {"actor_rollout_ref": {"rollout": {"tools": {"tool_instances": {
        "search": {"params": {"api_key": "sk-SECRET"}}}}}}})
    path = main_ppo.save_masked_config(cfg, tmp_path / "run")
    text = path.read_text()
    assert "sk-SECRET" not in text and "api_key: '***'" in text
    assert OmegaConf.create(text).actor_rollout_ref.rollout.n == 4
    assert main_ppo.save_masked_config(cfg) is None  # not under Hydra: nowhere to write


def test_cfg_job_prints_secrets_masked(tmp_path):
    """`--cfg job` (and `all`) are what users paste into issues: the key must not be in them."""
    key = "sk-PRINTED-SECRET-77"
    override = f"+actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key={key}"
    for kind in ("job", "all"):
        proc = run_main(["--cfg", kind, "actor_rollout_ref.model.path=/m", override], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert key not in proc.stdout + proc.stderr
        printed = OmegaConf.create(proc.stdout)
        assert printed.actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key == "***"
        assert printed.actor_rollout_ref.model.path == "/m"
        assert ("hydra" in printed) == (kind == "all")


@pytest.mark.parametrize("form", [["--cfg", "hydra"], ["--cfg", "job", "--package", "actor_rollout_ref.rollout.tools"],
                                  ["--cfg", "job", "--package=actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key"],
                                  ["--help"], ["--info", "all"], ["--info", "config"]])
def test_every_printing_form_masks_the_key(tmp_path, form):
    """[issue 33, item 1] Hydra's own --package, --help and --info printed an override's key in clear."""
    key = "sk-PRINTED-SECRET-78"
    override = f"+actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key={key}"
    proc = run_main([*form, "actor_rollout_ref.model.path=/m", override], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert key not in proc.stdout + proc.stderr and proc.stdout.strip()
    if "--package" in " ".join(form):
        assert proc.stdout.startswith("# @package actor_rollout_ref.rollout.tools") and "***" in proc.stdout


def test_a_users_own_config_path_writes_no_clear_key(tmp_path):
    """[issue 33, item 1] The .hydra/ copy (overrides.yaml, config.yaml) holds overrides in clear; our
    YAML turns it off, and main_ppo turns it off for a user's --config-path without that line too."""
    import shutil

    mine = tmp_path / "myconf"
    shutil.copytree(ROOT / "configs", mine)
    text = (mine / "ppo_trainer.yaml").read_text()
    (mine / "ppo_trainer.yaml").write_text("\n".join(l for l in text.splitlines() if "output_subdir" not in l))
    key = "sk-WRITTEN-SECRET-79"
    proc = run_main([f"--config-path={mine}", "--config-name=cpu_tiny", f"hydra.run.dir={tmp_path / 'run'}",
                     "actor_rollout_ref.model.path=/no/such/model",   # invalid: exits 2 after Hydra set up the run
                     f"+actor_rollout_ref.rollout.tools.tool_instances.search.params.api_key={key}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "myconf" not in p.parts]
    assert (tmp_path / "run" / "config.yaml") in written   # the masked copy
    assert not list(tmp_path.rglob(".hydra"))
    assert not [p for p in written if key in p.read_text(errors="replace")]
