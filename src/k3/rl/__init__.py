"""Rollouts and post-training (SPEC §7.5, §10): rollouts over a worker pool or Ray
(``k3.rl.rollout``), JSONL trajectories with replay (``k3.rl.trajectory``) and supervised
fine-tuning on chats and passing trajectories (``k3.rl.sft``). The task CLI is ``k3 task``
(``k3.cli.task``); the tasks themselves live in ``k3.tasks``."""
