"""Agent tasks and rollouts (SPEC §7.2, §7.5): the task format and clean-room verification
(``k3.rl.tasks``, ``k3.rl.verify``), rollouts over a worker pool or Ray (``k3.rl.rollout``) and
JSONL trajectories with replay (``k3.rl.trajectory``). The CLI is ``k3 task`` (``k3.rl.cli``)."""
