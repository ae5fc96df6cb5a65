"""Autonomous execution tasks (SPEC §7.2): the task format (``k3.tasks.format``), clean-room
verification with the verdict channel (``k3.tasks.verify``, ``k3.tasks.vharness``) and procedurally
generated task families (``k3.tasks.families``)."""
