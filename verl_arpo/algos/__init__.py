"""The algorithms: pure functions and their registries (docs/algorithms.md).

    core_algos        advantage estimators (ADV_ESTIMATOR_REGISTRY), policy losses (POLICY_LOSS_REGISTRY),
                      KL penalties and controllers, AEPO's entropy-balanced variants
    branching         ARPO's and AEPO's branch rules (BRANCH_RULES) and the entropy change they read
    rollout_mismatch  rollout/training mismatch metrics and truncated importance weights

Below the rollout, the workers and the trainer, above the config: nothing here imports either of those
layers, so a new algorithm is one registered function that any of them can use.
"""
