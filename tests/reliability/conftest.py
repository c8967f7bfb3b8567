"""Fixtures of the reliability suite (fault injection and fuzzing, issue 9)."""
import pytest


@pytest.fixture(scope="session")
def rel_tok():
    """The offline tiny tokenizer (built in memory: no model, ~1 s)."""
    from verl_arpo.utils.tiny_model import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.model_max_length = 10**9  # huge fuzzed texts: no "longer than the maximum" warnings
    return tok


@pytest.fixture
def search_api():
    from rel_helpers import FakeSearchAPI

    api = FakeSearchAPI()
    yield api
    api.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(name, size) -> a fresh tmpfs of `size` under tmp_path (root only, else skip); unmounted after."""
    import os
    import subprocess

    mounted = []

    def mount(name, size):
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                               capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
