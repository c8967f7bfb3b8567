"""The multi-turn tool rollout (docs/algorithms.md): the agent loop in its two modes, the branch rules,
the engines and the tools. `build_agent_loop` lives here, above both loop modules, so neither
imports the other's factory."""

from verl_arpo.config import ROLLOUT_MODES, RolloutSection

__all__ = ["build_agent_loop"]


def build_agent_loop(mode: str, engine, tokenizer, executor, config: RolloutSection, *, call_limit: int,
                     seed: int, chat_template_kwargs: dict | None = None):
    """`rollout.mode`: sync_with_tool (rounds, agent_loop.py) or async_with_tool (no round barriers,
    async_agent_loop.py); both return the same DataProto. call_limit, seed, chat_template_kwargs: see AgentLoop."""
    if mode == "sync_with_tool":
        from verl_arpo.workers.rollout.agent_loop import AgentLoop

        return AgentLoop(engine, tokenizer, executor, config, call_limit=call_limit, seed=seed,
                         chat_template_kwargs=chat_template_kwargs)
    if mode == "async_with_tool":
        from verl_arpo.workers.rollout.async_agent_loop import AsyncAgentLoop

        return AsyncAgentLoop(engine, tokenizer, executor, config, call_limit=call_limit, seed=seed,
                         chat_template_kwargs=chat_template_kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.mode={mode!r}; choose one of {list(ROLLOUT_MODES)}")
