"""fsdp_config.grad_sync_once: the actor's and the critic's gradients reduce-scattered once a mini-batch
(sharded_model.sync_gradients), on two real gloo ranks, against the per-micro-batch reduction."""
import torch

from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic
from test_dp_actor import load_model, run_two_ranks
from test_dp_critic import load_critic, make_batch as critic_batch
from worker_configs import actor_kwargs, critic_kwargs, gloo_rank_counting, rank_share


def _grad_sync_rank(rank, world, port, model_dir, data_path, out_path):
    """One actor update and one critic update per setting, counting FSDP2's gradient reduce-scatters."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group   # where FSDP2 reduces

    from verl_arpo.workers.sharded_model import shard_fsdp2

    with gloo_rank_counting(rank, world, port, param_group, "foreach_reduce") as calls:
        mesh, data, half = rank_share(data_path, rank, world)
        full_critic = critic_batch(load_model(model_dir).config.vocab_size, B=2 * half, seed=3)
        critic_data = full_critic.slice(rank * half, (rank + 1) * half)
        results = {}
        for once in (False, True):
            model = shard_fsdp2(load_model(model_dir), mesh)
            actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                         **actor_kwargs(loss_agg_mode="token-mean", use_dynamic_bsz=True,
                                                        ppo_max_token_len_per_gpu=20, ppo_mini_batch_size=half,
                                                        fsdp_config={"grad_sync_once": once}))
            calls["n"] = 0
            metrics = actor.update_policy(data)
            reduces = calls["n"]
            units = sum(1 for m in model.modules() if hasattr(m, "reshard"))
            value_model = shard_fsdp2(load_critic(model_dir), mesh)
            critic = DataParallelPPOCritic(
                critic_module=value_model, critic_optimizer=torch.optim.SGD(value_model.parameters(), lr=0.5),
                **critic_kwargs(ppo_mini_batch_size=half, ppo_micro_batch_size_per_gpu=1, cliprange_value=0.2,
                                model={"fsdp_config": {"grad_sync_once": once}}))
            calls["n"] = 0
            critic_metrics = critic.update_critic(critic_data)
            results[once] = dict(params={k: v.full_tensor() for k, v in model.state_dict().items()},
                                 critic_params={k: v.full_tensor() for k, v in value_model.state_dict().items()},
                                 metrics=metrics, critic_metrics=critic_metrics, reduces=reduces,
                                 critic_reduces=calls["n"], units=units,
                                 critic_units=sum(1 for m in value_model.modules() if hasattr(m, "reshard")))
        if rank == 0:
            torch.save(results, out_path)


def test_gradients_reduced_once_a_mini_batch_give_the_same_update(tiny_model_dir, tmp_path):
    """Each FSDP unit reduce-scatters once for a mini-batch of several micro-batches (the plain path once
    a micro-batch), and the weights after the step equal the plain path's up to the order of the
    fp32 sum (Σ_ranks Σ_micro instead of Σ_micro Σ_ranks): both the actor's and the critic's."""
    base, once = (r := run_two_ranks(_grad_sync_rank, tiny_model_dir, tmp_path))[False], r[True]
    start, moved = load_model(tiny_model_dir).state_dict(), 0.0
    for k, v in base["params"].items():
        torch.testing.assert_close(once["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        moved = max(moved, (v - start[k]).abs().max().item())
    assert moved > 1e-3                                   # the step moved the weights: the comparison has teeth
    for k, v in base["critic_params"].items():
        torch.testing.assert_close(once["critic_params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert abs(once["metrics"]["actor/grad_norm"][0] - base["metrics"]["actor/grad_norm"][0]) <= 1e-5 * base["metrics"]["actor/grad_norm"][0]
    assert once["metrics"]["actor/pg_loss"] == base["metrics"]["actor/pg_loss"]   # the same forward
    assert once["reduces"] == once["units"]                # one reduce-scatter per unit for the whole mini-batch
    assert base["reduces"] >= 2 * base["units"]            # at least two micro-batches, each reducing
    assert once["critic_reduces"] == once["critic_units"]
    assert base["critic_reduces"] == 4 * base["critic_units"]   # 4 rows a rank, one a micro-batch
