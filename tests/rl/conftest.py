"""Real namespace sandboxes for the rollout and post-training tests (tests/env/task_sandboxes.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "env"))
from task_sandboxes import sandbox_fixtures  # noqa: E402

env_root, sandboxes = sandbox_fixtures("k3env-rl")
