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
