"""The agent harness (SPEC §7.3, §7.4): ``AgentTurn`` (turns), providers (``OpenAICompatible``,
``LocalEngine``, ``Scripted``), tools over a ``Sandbox``, the fail-closed policy chain with its
shell parser (policy, commands, shell), the loop with budgets and compaction (harness) and seeded
harness randomization (randomize)."""
