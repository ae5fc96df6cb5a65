"""Inference: the engine (continuous batching, SPEC §6.1), sampling, and one-call generation.

``generate`` is bound eagerly: the submodule ``k3.infer.generate`` has the same name, and the
function must win the package attribute. The other names load lazily.
"""

from k3.infer.generate import generate

__all__ = ["Engine", "SamplingParams", "TokenEvent", "generate", "sample_next_token", "load_run_model"]

_WHERE = {"Engine": "engine", "SamplingParams": "sampling", "sample_next_token": "sampling",
          "TokenEvent": "scheduler", "load_run_model": "run_model"}


def __getattr__(name):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f"k3.infer.{_WHERE[name]}"), name)
    raise AttributeError(name)
