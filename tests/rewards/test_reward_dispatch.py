"""default_compute_score dispatch by data source."""
import pytest

import verl_arpo.utils.reward_score as rs

GOOD_DR = "<think>t</think><answer>\\boxed{Paris}</answer>"


@pytest.mark.parametrize(
    "source, scorer",
    [
        ("math", "math"), ("aime24", "math"), ("MATH500", "math"), ("gsm8k", "math"),
        ("numina_cn_k12", "math"), ("arpo_toy_math_add", "math"),
        ("openai/gsm8k", "gsm8k"), ("arpo_toy_gsm8k", "gsm8k"),
        ("hotpotqa", "deep_research"), ("2wiki", "deep_research"), ("musique", "deep_research"),
        ("bamboogle", "deep_research"), ("gaia", "deep_research"), ("HLE", "deep_research"),
        ("webwalker", "deep_research"), ("xbench", "deep_research"), ("frames", "deep_research"),
        ("simpleqa", "deep_research"), ("nq", "deep_research"), ("triviaqa", "deep_research"),
        ("arpo_toy_search", "qa_f1"), ("arpo_toy_multi", "qa_f1"),
    ],
)
def test_routing(source, scorer):
    assert rs.get_scorer(source) is rs.SCORERS[scorer]


def test_default_compute_score_results():
    assert rs.default_compute_score("hotpotqa", GOOD_DR, "Paris")["f1"] == 1.0
    assert rs.default_compute_score("math500", "\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0
    assert rs.default_compute_score("openai/gsm8k", "#### 3", "3")["score"] == 1.0


def test_unknown_source_names_the_fix():
    with pytest.raises(ValueError) as err:
        rs.default_compute_score("my_new_benchmark", "x", "y")
    msg = str(err.value)
    assert "my_new_benchmark" in msg
    assert "custom_reward_function.path" in msg and "custom_reward_function.name" in msg


def test_register_data_source(monkeypatch):
    monkeypatch.setattr(rs, "DATA_SOURCE_SCORERS", dict(rs.DATA_SOURCE_SCORERS))
    monkeypatch.setattr(rs, "DATA_SOURCE_PREFIXES", dict(rs.DATA_SOURCE_PREFIXES))
    monkeypatch.setattr(rs, "SCORERS", dict(rs.SCORERS))
    rs.register_data_source("My_QA", "deep_research")
    assert rs.default_compute_score("my_qa", GOOD_DR, "Paris")["score"] == 1.0
    rs.register_data_source("const_", lambda *a, **k: 0.25, prefix=True)
    assert rs.default_compute_score("const_x", "", "") == 0.25
    with pytest.raises(ValueError, match="unknown scorer"):
        rs.register_data_source("z", "nope")


def test_rewards_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, verl_arpo.utils.reward_score as r; "
            "r.default_compute_score('math', '\\\\boxed{0.5}', '1/2'); "
            "import verl_arpo.utils.reward_score.custom; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
