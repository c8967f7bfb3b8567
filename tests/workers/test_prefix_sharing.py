"""Prefix-shared packing (use_prefix_sharing) against independent references.

The tree is checked against the set of distinct prefixes of the rows (by hand and at random), the
forward and the update against per-row HF forwards and the token-by-token objective of
test_dp_actor, and the micro-batch / rank partitions against the budget and group rules.
"""
import logging
import random

import pytest
import torch
from tensordict import TensorDict
from test_dp_actor import (P, R, actor_grad, assert_grads_close, assert_matches_rows, load_model, per_row_outputs,
                           reference_grad)

from verl_arpo.protocol import DataProto
from verl_arpo.utils.prefix_packing import ancestor_mask, build_prefix_tree, tree_size, valid_rows, visibility_ends
from verl_arpo.utils.seqlen_balancing import balance_batch_indices, rearrange_micro_batches
from verl_arpo.utils.torch_functional import compute_position_id_with_mask
from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
from worker_configs import log_probs


def padded(prompts, responses, p=P, r=R):
    """Left-padded prompts, right-padded responses (pad id 0)."""
    ids = torch.zeros(len(prompts), p + r, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, (q, a) in enumerate(zip(prompts, responses)):
        ids[b, p - len(q):p], ids[b, p:p + len(a)] = torch.tensor(q), torch.tensor(a)
        attn[b, p - len(q):p + len(a)] = 1
    return ids, attn


def node_paths(tree):
    """The token path root → node of every node, read back from the rows' node indices."""
    paths = {}
    for row in tree.node_index:
        nodes = row[row >= 0].tolist()
        for d, n in enumerate(nodes):
            paths[n] = tuple(tree.tokens[nodes[:d + 1]].tolist())
    return paths


def test_tree_by_hand():
    # two samples of prompt [5,6], one a branch of the other after token 9; one other prompt
    ids, attn = padded([[5, 6], [5, 6], [7]], [[9, 10], [9, 11, 12], [9]])
    tree = build_prefix_tree(ids, attn)
    assert tree.tokens.tolist() == [5, 6, 9, 10, 11, 12, 7, 9]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 4, 0, 1]
    assert tree.node_index[0][attn[0].bool()].tolist() == [0, 1, 2, 3]
    assert tree.node_index[1][attn[1].bool()].tolist() == [0, 1, 2, 4, 5]
    assert tree.node_index[2][attn[2].bool()].tolist() == [6, 7]
    assert (tree.node_index[~attn.bool()] == -1).all()
    mask = ancestor_mask(tree)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 4],
                            5: [0, 1, 2, 4, 5], 6: [6], 7: [6, 7]}.items():
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)
    assert tree_size(valid_rows(ids, attn)) == 8
    # subtrees as index ranges: node 2's subtree is nodes 2..5, node 3 is a leaf, node 6 ends the row
    assert visibility_ends(tree.depth).tolist() == [6, 6, 6, 4, 6, 6, 8, 8]


def relation_of_ends(ends):
    """The [N, N] mask `k ≤ q < end(k)`, written out pair by pair."""
    n = ends.numel()
    return torch.tensor([[k <= q < ends[k] for k in range(n)] for q in range(n)])


def test_visibility_ends_of_packed_rows():
    # plain packing: positions restart at 0 per row; every row is causal on its own
    depth = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    ends = visibility_ends(depth)
    assert ends.tolist() == [3, 3, 3, 5, 5, 6, 10, 10, 10, 10]
    expected = torch.zeros(10, 10, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 6), (6, 10)):
        expected[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(relation_of_ends(ends), expected)


def random_depth_first(rng, n):
    """Depths of n nodes in depth-first preorder: each node a child of the previous one or of one of
    its ancestors, or a new root (packed rows and prefix trees alike)."""
    depth = [0]
    while len(depth) < n:
        depth.append(rng.randint(0, depth[-1] + 1) if rng.random() < 0.3 else depth[-1] + 1)
    return torch.tensor(depth)


@pytest.mark.parametrize("n,block,seed", [(1, 128, 0), (200, 128, 1), (256, 128, 2), (300, 128, 3),
                                          (97, 16, 4), (128, 16, 5), (130, 16, 6), (75, 8, 7)])
def test_tree_block_mask_table_equals_create_block_mask(n, block, seed):
    """tree_block_mask builds its block table from end(k) alone (no N × N mask); it must be the table
    FlexAttention's own create_block_mask finds by evaluating the mask on every pair: partial and
    full blocks, counts and order, and the same mask inside the blocks (to_dense)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from verl_arpo.workers.training_core import tree_block_mask

    rng = random.Random(seed)
    depth = random_depth_first(rng, n)
    ends = visibility_ends(depth)
    ours = tree_block_mask(depth, block_size=block)
    reference = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < ends[kv]), None, None, n, n,
                                  device="cpu", BLOCK_SIZE=block)
    for field in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, field), getattr(reference, field)), field
    for count, field in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for i, c in enumerate(getattr(ours, count)[0, 0].tolist()):   # the listed blocks; the tail is unused
            assert getattr(ours, field)[0, 0, i, :c].tolist() == getattr(reference, field)[0, 0, i, :c].tolist()
    assert ours.seq_lengths == (n, n)
    dense = ours.to_dense()[0, 0].bool()   # [q blocks, kv blocks]: where the kernel computes anything
    relation = relation_of_ends(ends)
    nb = dense.shape[0]
    padded = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    padded[:n, :n] = relation
    reached = padded.view(nb, block, nb, block).any(3).any(1)
    assert torch.equal(dense, reached)   # a block is listed iff some pair in it is visible


def test_tree_block_mask_memory_is_linear_in_the_nodes():
    """At 16,384 nodes the N × N mask create_block_mask evaluates without compilation is 256 Mi pairs
    (~2.5 GiB of peak memory in its vmap); tree_block_mask's table is 128 × 128 blocks. Measured as the
    peak RSS growth of a fresh process."""
    import subprocess
    import sys

    code = """
import resource, torch
from verl_arpo.workers.training_core import tree_block_mask
depth = torch.arange(16384) % 300   # packed rows of 300 tokens
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = tree_block_mask(depth)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, int(mask.kv_num_blocks.sum()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    grown_mib, listed = out.stdout.split()
    assert float(grown_mib) < 64, out.stdout
    assert 128 <= int(listed) < 128 * 3   # the diagonal and the blocks a 300-token row spans


@pytest.mark.parametrize("seed", range(4))
def test_tree_is_the_set_of_distinct_prefixes(seed):
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(3):
        q = [rng.randint(3, 6) for _ in range(rng.randint(1, P))]
        stem = [rng.randint(3, 5) for _ in range(rng.randint(0, 3))]  # shared branch prefix
        for _ in range(rng.randint(1, 4)):
            prompts.append(q)
            responses.append(stem + [rng.randint(3, 5) for _ in range(rng.randint(1, R - len(stem)))])
    ids, attn = padded(prompts, responses)
    tree = build_prefix_tree(ids, attn)
    rows = [tuple(r) for r in valid_rows(ids, attn)]
    prefixes = {r[:k] for r in rows for k in range(1, len(r) + 1)}
    paths = node_paths(tree)
    assert sorted(paths.values()) == sorted(prefixes)  # one node per distinct prefix
    assert tree_size(rows) == len(prefixes) == tree.tokens.numel()
    assert all(tree.depth[n] == len(path) - 1 for n, path in paths.items())
    mask = ancestor_mask(tree)
    for i, pi in paths.items():
        for j, pj in paths.items():
            assert bool(mask[i, j]) == (pi[:len(pj)] == pj), (i, j)
    assert torch.equal(relation_of_ends(visibility_ends(tree.depth)), mask)  # the O(N) form of the same mask


def shared_batch(vocab, seed=0):
    """Groups with a common prompt; inside a group, branches share a response prefix."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for size, stem in ((3, 2), (2, 0), (1, 0), (2, 3)):
        q = torch.randint(3, vocab, (int(torch.randint(2, P + 1, (1,), generator=g)),), generator=g).tolist()
        s = torch.randint(3, vocab, (stem,), generator=g).tolist()
        for _ in range(size):
            n = int(torch.randint(1, R - stem + 1, (1,), generator=g))
            prompts.append(q)
            responses.append(s + torch.randint(3, vocab, (n,), generator=g).tolist())
    ids, attn = padded(prompts, responses)
    b = len(prompts)
    resp_mask = attn[:, P:].clone()
    resp_mask[1, 1] = 0  # a tool-result token inside a response
    adv = (torch.randn(b, 1, generator=g) + 0.2 * torch.randn(b, R, generator=g)) * resp_mask
    old = -torch.log(torch.tensor(float(vocab))) + 0.25 * torch.randn(b, R, generator=g)
    return DataProto.from_dict(
        tensors=dict(input_ids=ids, attention_mask=attn, position_ids=compute_position_id_with_mask(attn),
                     responses=ids[:, P:], response_mask=resp_mask, advantages=adv, old_log_probs=old))


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager", "flex_attention"])
def test_shared_forward_equals_per_row_forwards(tiny_model_dir, attn_impl):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn_impl, dtype=torch.float32)
    data = shared_batch(model.config.vocab_size, seed=1)
    # flex_attention's tree is a BlockMask (k ≤ q < end(k)); its reference rows run through sdpa, so
    # the check does not lean on the kernel it checks (FlexAttention has no CPU backward: no grad here)
    reference = model if attn_impl != "flex_attention" else load_model(tiny_model_dir)
    with torch.no_grad():
        rows = per_row_outputs(reference, data)
    actor = DataParallelPPOActor(None, model, use_remove_padding=True, use_prefix_sharing=True)
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        lp, ent = actor.compute_log_prob(data, log_probs(use_dynamic_bsz=True, max_token_len=1000), calculate_entropy=True)
    finally:
        hook.remove()
    # one forward over the tree: fewer tokens than the rows hold
    assert seen == [tree_size(valid_rows(data.batch["input_ids"], data.batch["attention_mask"]))]
    assert seen[0] < int(data.batch["attention_mask"].sum())
    assert_matches_rows(lp, ent, rows, data)


def test_shared_update_gradient_is_the_minibatch_objective(model):
    data = shared_batch(model.config.vocab_size, seed=2)
    ref = reference_grad(model, data)
    for budget in (1000, 16):  # one micro-batch; a budget that cuts the 3-row group into runs
        micro, _ = rearrange_micro_batches(data.batch, budget, share_prefix=True)
        assert len(micro) == (1 if budget == 1000 else 5)
        grad, _ = actor_grad(model, data, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget,
                             use_remove_padding=True, use_prefix_sharing=True)
        assert_grads_close(grad, ref)


def test_actor_refuses_sharing_it_cannot_do(tiny_model_dir, model):
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        DataParallelPPOActor(None, model, use_prefix_sharing=True)
    flash = load_model(tiny_model_dir)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation=sdpa"):
        DataParallelPPOActor(None, flash, use_remove_padding=True, use_prefix_sharing=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


# --------------------------------------------------------------------------------------------
# partitions
# --------------------------------------------------------------------------------------------
def _td(prompts, responses):
    ids, attn = padded(prompts, responses, p=8, r=12)
    return TensorDict({"input_ids": ids, "attention_mask": attn, "responses": ids[:, 8:]}, batch_size=[len(prompts)])


@pytest.mark.parametrize("seed", range(4))
def test_micro_batches_keep_a_prompts_rows_together_within_the_budget(seed):
    rng = random.Random(seed)
    prompts, responses, group_of = [], [], []
    for g in range(rng.randint(2, 6)):
        q = [100 + g] + [rng.randint(3, 50) for _ in range(rng.randint(0, 7))]
        for _ in range(rng.randint(1, 4)):
            prompts.append(q)
            responses.append([rng.randint(3, 50) for _ in range(rng.randint(1, 12))])
            group_of.append(g)
    td = _td(prompts, responses)
    rows = valid_rows(td["input_ids"], td["attention_mask"])
    budget = rng.randint(20, 40)
    micro, parts = rearrange_micro_batches(td, budget, share_prefix=True)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    for p, mb in zip(parts, micro):
        assert torch.equal(mb["input_ids"], td["input_ids"][p])
        assert tree_size([rows[i] for i in p]) <= budget or len(p) == 1
    for g in set(group_of):  # a group whose tree fits the budget is never split
        members = [i for i, x in enumerate(group_of) if x == g]
        if tree_size([rows[i] for i in members]) <= budget:
            assert any(set(members) <= set(p) for p in parts), (g, parts)


def test_micro_batches_count_tree_tokens():
    # 4 rows of one 8-token prompt, 4-token responses: 48 tokens in rows, 24 in the tree
    td = _td([[9] * 8] * 4, [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7, 8, 9], [6, 7, 8, 10]])
    assert len(rearrange_micro_batches(td, 24, share_prefix=True)[1]) == 1
    assert len(rearrange_micro_batches(td, 24)[1]) == 2  # row tokens: 48 → two micro-batches


def test_rank_balance_keeps_groups_whole(caplog):
    lens = [30, 31, 10, 12, 50, 52, 20, 22]
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    order = balance_batch_indices(lens, 2, groups=uids)
    assert sorted(order) == list(range(8))
    shards = [order[:4], order[4:]]
    for s in shards:
        assert len({uids[i] for i in s}) == 2  # two whole groups per rank
    totals = sorted(sum(lens[i] for i in s) for s in shards)
    sums = {u: sum(n for n, x in zip(lens, uids) if x == u) for u in "abcd"}  # a 61, b 22, c 102, d 42
    best = min((sorted([sums["a"] + sums[o], 227 - sums["a"] - sums[o]]) for o in "bcd"), key=lambda t: t[1] - t[0])
    assert totals == best == [103, 124]
    with caplog.at_level(logging.WARNING):
        fallback = balance_batch_indices(lens[:6], 2, groups=["a", "a", "a", "b", "b", "c"])
    assert sorted(fallback) == list(range(6)) and "cannot be split evenly" in caplog.text


def test_rank_balance_weighs_a_group_by_its_prefix_tree():
    """With the rows' tokens, a group weighs the tokens a prefix-shared forward computes. Every group
    below has 4 rows of 20 tokens (80 in rows), so the row sums cannot tell them apart; their trees
    (by hand: a 10-token prompt plus the distinct answer tokens) are a 20, b 50, c 50, d 20."""
    same, distinct = [[1] * 10] * 4, [[1] * 10, [2] * 10, [3] * 10, [4] * 10]
    prompt = {g: [100 + g] * 10 for g in range(4)}
    answers = {0: same, 1: distinct, 2: distinct, 3: same}
    rows = [prompt[g] + a for g in range(4) for a in answers[g]]
    uids = [g for g in range(4) for _ in range(4)]
    assert [tree_size(rows[4 * g:4 * g + 4]) for g in range(4)] == [20, 50, 50, 20]
    order = balance_batch_indices([len(r) for r in rows], 2, groups=uids, tokens=rows)
    shard_trees = sorted(sum(tree_size(rows[4 * g:4 * g + 4]) for g in {uids[i] for i in s})
                         for s in (order[:8], order[8:]))
    assert shard_trees == [70, 70]   # one heavy and one light group a rank (the only even split)


def _random_groups(rng, groups, n, prompt_max=8, resp_max=12):
    prompts, responses = [], []
    for g in range(groups):
        q = [100 + g] + [rng.randint(3, 50) for _ in range(rng.randint(0, prompt_max - 1))]
        for _ in range(n):
            prompts.append(q)
            responses.append([rng.randint(3, 50) for _ in range(rng.randint(1, resp_max))])
    return prompts, responses


def _count_rank(rank, world, port, out_path, trials):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        seen = []
        for trial in range(trials):
            rng = random.Random(trial * 10 + rank)  # each rank its own rows, same budget
            td = _td(*_random_groups(rng, groups=4, n=4))
            budget = random.Random(trial).randint(15, 60)
            _, parts = rearrange_micro_batches(td, budget, share_prefix=True)
            rows = valid_rows(td["input_ids"], td["attention_mask"])
            ok = sorted(i for p in parts for i in p) == list(range(16)) and all(
                tree_size([rows[i] for i in p]) <= budget or len(p) == 1 for p in parts)
            seen.append((len(parts), ok))
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
        if rank == 0:
            torch.save(gathered, out_path)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_ranks_get_the_same_micro_batch_count(tmp_path):
    """Two gloo ranks with different rows: the same count every time (FSDP deadlocks otherwise),
    each micro-batch within the budget. Unequal needs force both paths: a fresh k-way split of
    the groups, and splitting groups into rows."""
    import torch.multiprocessing as mp
    from test_dp_actor import _free_port

    out = tmp_path / "counts.pt"
    mp.start_processes(_count_rank, args=(2, _free_port(), str(out), 60), nprocs=2, join=True, start_method="spawn")
    ranks = torch.load(out, weights_only=False)
    for (n0, ok0), (n1, ok1) in zip(*ranks):
        assert n0 == n1 and ok0 and ok1
    # rank-local needs differed in some trials, so the equalising paths ran
    local = [len(rearrange_micro_batches(_td(*_random_groups(random.Random(t * 10 + r), 4, 4)),
                                         random.Random(t).randint(15, 60), share_prefix=True)[1])
             for t in range(60) for r in range(2)]
    assert any(a != b for a, b in zip(local[::2], local[1::2]))


def test_flex_attention_trainer_on_cpu_is_refused_by_name(tiny_model_dir):
    """FlexAttention runs forward on the CPU but has no backward there: a CPU trainer with it fails when
    it is built, naming the key, not at its first training forward; a scorer (no optimizer) is fine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="flex_attention", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.attn_implementation=flex_attention"):
        DataParallelPPOActor(None, model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    DataParallelPPOActor(None, model)  # the reference policy / log-prob pass
    # what the refusal spares the user: a forward that needs a backward raises on the CPU
    with pytest.raises(NotImplementedError, match="backward"):
        model(input_ids=torch.tensor([[3, 4, 5]]))
