"""LocalSearchTool (BM25) and the bundled fictional corpus."""
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "search_cache" / "local_corpus.jsonl"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "search_cache" / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    return _load_generator()


@pytest.fixture(scope="module")
def search():
    return LocalSearchTool(max_results=3, result_length=1000)


def test_committed_corpus_matches_generator(gen):
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == gen.make_corpus(0)
    assert 200 <= len(lines) <= 1000 and CORPUS.stat().st_size < 1_000_000
    assert gen.make_corpus(1) != gen.make_corpus(0) and gen.make_corpus(1) == gen.make_corpus(1)


def test_facts_are_in_their_documents(gen):
    docs = {d["id"]: d for d in gen.make_corpus(0)}
    facts = gen.fictional_facts(0)
    assert {f["type"] for f in facts} == {"town", "person", "company"}
    for f in facts:
        doc = docs[f["doc_id"]]
        assert doc["title"] == f["entity"]
        value = f"{f['value']:,}" if f["attribute"] in ("population", "employees") else str(f["value"])
        assert value in doc["text"], (f, doc)
    titles = [d["title"] for d in docs.values()]
    assert len(set(titles)) == len(titles)  # entity names are unique


@pytest.mark.parametrize("kind, template", [
    ("town", "When was {e} founded and by whom?"),
    ("person", "What did {e} invent?"),
    ("company", "Who founded {e}?"),
])
def test_top_hit_is_the_entity_document(gen, search, kind, template):
    entities = sorted({f["entity"] for f in gen.fictional_facts(0) if f["type"] == kind})
    for entity in random.Random(kind).sample(entities, 25):
        out = search.execute(template.format(e=entity))
        assert out.startswith(f"Page 1: {entity}: "), (entity, out[:200])


def test_output_format_and_limits(gen):
    tool = LocalSearchTool(max_results=2, result_length=40)
    town = next(f for f in gen.fictional_facts(0) if f["type"] == "town")
    out = tool.execute(f"{town['entity']} population")
    lines = out.split("\n")
    assert len(lines) == 2 and lines[0].startswith("Page 1: ") and lines[1].startswith("Page 2: ")
    assert all(len(ln.split(": ", 1)[1]) <= 40 for ln in lines)
    doc = next(d for d in gen.make_corpus(0) if d["id"] == town["doc_id"])
    assert lines[0] == "Page 1: " + f"{doc['title']}: {doc['text']}"[:40]


def test_no_results(search):
    assert search.execute("qqqzzz xxyyww") == "No search results found."
    assert search.execute("the of and") == "No search results found."  # stop words only
    assert search.execute("   ").startswith("Error: empty search query")


def test_uses_the_shared_cache(tmp_path, gen):
    tool = LocalSearchTool(cache_file=str(tmp_path / "local.json"), max_results=1)
    entity = gen.fictional_facts(0)[0]["entity"]
    first = tool.execute(entity)
    assert tool.execute(entity) == first
    assert tool.metrics() == {"cache_hits": 1, "cache_misses": 1, "cache_writes": 1, "cache_hit_rate": 0.5}
    tool.close()
    assert (tmp_path / "local.sqlite").exists()


def test_custom_corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in [
        {"id": "a", "title": "Apples", "text": "Apples grow on trees."},
        {"id": "b", "title": "Rivers", "text": "Rivers flow to the sea."}]) + "\n")
    tool = LocalSearchTool(corpus_path=str(path), max_results=5, api_key="ignored", zone="ignored")
    assert tool.execute("where do rivers flow") == "Page 1: Rivers: Rivers flow to the sea."


def test_the_references_bing_cache_never_answers_for_bm25(tmp_path, gen, caplog):
    """[issue 34, item 5] ppo_trainer_dr.yaml suggests swapping the class path to this tool while
    keeping the reference's search_cache.json: its Bing answers were imported into whichever tool
    opened it, so BM25 served Bing's pages. Now only the Bing tool imports it; BM25 answers from its
    corpus, and the log says why the file was left alone."""
    import logging

    entity = gen.fictional_facts(0)[0]["entity"]
    (tmp_path / "search_cache.json").write_text(json.dumps({entity: "Page 1: an answer from Bing"}))
    plain = LocalSearchTool(max_results=1).execute(entity)
    with caplog.at_level(logging.INFO, logger="verl_arpo"):
        tool = LocalSearchTool(cache_file=str(tmp_path / "search_cache.json"), max_results=1)
    answer = tool.execute(entity)
    tool.close()
    assert answer == plain and "Bing" not in answer
    assert "not importing" in caplog.text and "Bing tool's answers" in caplog.text


JAX_STAND_IN = '''
import json, os, numpy as np
LOG = os.environ["JAX_STAND_IN_LOG"]

def top_k(x, k):  # what jax.lax.top_k returns, recorded with the platform JAX would have chosen
    with open(LOG, "a") as f:
        f.write(json.dumps({"platforms": os.environ.get("JAX_PLATFORMS"), "n": int(np.size(x))}) + "\\n")
    idx = np.argsort(-np.asarray(x), kind="stable")[:k]
    return np.asarray(x)[idx], idx
'''


@pytest.mark.parametrize("user_platforms", [None, "cuda"])
def test_bm25s_keeps_an_installed_jax_off_the_gpu(tmp_path, user_platforms):
    """bm25s imports JAX where installed and runs jax.lax.top_k at import, which on a GPU machine
    preallocates 75% of the GPU in the training worker (seen on an H200). JAX is not installable
    here, so a stand-in `jax` package records the JAX_PLATFORMS each top_k call ran under: the
    import-time call must run with JAX on the CPU (a user's own setting is kept), and retrieval
    itself must not call JAX at all (numpy's top-k, the same with or without JAX)."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("from . import lax\n")
    (tmp_path / "jax" / "lax.py").write_text(JAX_STAND_IN)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(PYTHONPATH=f"{tmp_path}:{ROOT}", JAX_STAND_IN_LOG=str(log))
    if user_platforms:
        env["JAX_PLATFORMS"] = user_platforms
    code = ("from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool\n"
            "t = LocalSearchTool(max_results=3)\n"
            "import sys; assert 'jax' in sys.modules\n"
            "print(len(t.search('capital city river mountain')))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 0                     # the search answered
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert calls == [{"platforms": user_platforms or "cpu", "n": 5}], calls   # bm25s's import-time call only
