"""Harness randomization: seeded (same seed -> same draw, in another process too), reversible,
recorded, and valid for every seed."""

import json
import random
import subprocess
import sys

import pytest

from k3.agent.randomize import (ARG_ALIASES, CONTEXT_STRATEGIES, PROMPT_TEMPLATES, TOOL_ALIASES,
                                HarnessConfig)
from k3.agent.tools import tool_schemas
from k3.tasks.tool_specs import TOOL_SPECS
from k3.errors import ConfigError


def test_same_seed_same_harness_also_in_a_fresh_process():
    a = HarnessConfig.from_seed(1234).as_dict()
    random.seed(99)  # the global RNG state must not matter
    assert HarnessConfig.from_seed(1234).as_dict() == a
    code = "import json; from k3.agent.randomize import HarnessConfig; print(json.dumps(HarnessConfig.from_seed(1234).as_dict()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == a


def test_seeds_cover_every_axis():
    draws = [HarnessConfig.from_seed(s) for s in range(200)]
    for tool, names in TOOL_ALIASES.items():
        assert {d.tool_names[tool] for d in draws} == set(names)
    for arg, names in ARG_ALIASES.items():
        assert {d.arg_names[arg] for d in draws} == set(names)
    assert {d.template for d in draws} == set(range(len(PROMPT_TEMPLATES)))
    assert {d.context_strategy for d in draws} == set(CONTEXT_STRATEGIES)
    assert {d.memory for d in draws} == {True, False}
    assert len({json.dumps(d.as_dict(), sort_keys=True) for d in draws[:20]}) == 20


def test_no_seed_is_the_canonical_harness():
    c = HarnessConfig.from_seed(None)
    assert c.tool_names == {k: k for k in TOOL_SPECS} and c.arg_names == {k: k for k in ARG_ALIASES}
    assert (c.template, c.context_strategy, c.memory) == (0, "drop_old_tool_outputs", False)


@pytest.mark.parametrize("seed", range(30))
def test_renaming_round_trips_and_schemas_use_the_new_names(seed):
    c = HarnessConfig.from_seed(seed)
    call = ("edit", {"path": "a.py", "old": "x", "new": "y"})
    name, args = c.to_model(*call)
    assert c.from_model(name, args) == call
    schemas = {s["function"]["name"]: s["function"]["parameters"] for s in tool_schemas(c, list(TOOL_SPECS))}
    assert set(schemas) == set(c.tool_names.values())
    props = schemas[c.tool_names["edit"]]["properties"]
    assert set(props) == {c.arg_names["path"], c.arg_names["old"], c.arg_names["new"]} == set(args)
    assert c.tool_names["submit"] in c.system_prompt("/workspace", 3)
    assert HarnessConfig.from_dict(json.loads(json.dumps(c.as_dict()))).as_dict() == c.as_dict()


def test_a_name_no_tool_has_maps_to_none():
    assert HarnessConfig.from_seed(3).from_model("rm_everything", {})[0] is None


def test_a_bad_recorded_config_is_refused():
    d = HarnessConfig.from_seed(5).as_dict()
    with pytest.raises(ConfigError, match="unknown"):
        HarnessConfig.from_dict({**d, "colour": "red"})
    with pytest.raises(ConfigError, match="context_strategy"):
        HarnessConfig.from_dict({**d, "context_strategy": "forget_everything"})
    with pytest.raises(ConfigError, match="distinct"):
        HarnessConfig.from_dict({**d, "tool_names": {k: "same" for k in TOOL_ALIASES}})
    with pytest.raises(ConfigError, match="seed"):
        HarnessConfig.from_seed("7")
