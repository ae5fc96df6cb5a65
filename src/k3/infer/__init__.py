"""Inference: the engine (continuous batching, SPEC §6.1), sampling, and one-call generation.

Names load lazily so ``import k3.infer`` stays light (the CLI's help must not build the stack).
"""

__all__ = ["Engine", "SamplingParams", "TokenEvent", "generate", "sample_next_token", "load_run_model",
           "sample_main"]

_WHERE = {"Engine": "engine", "SamplingParams": "sampling", "sample_next_token": "sampling",
          "TokenEvent": "scheduler", "generate": "generate", "load_run_model": "run_model",
          "sample_main": "run_model"}


def __getattr__(name):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f"k3.infer.{_WHERE[name]}"), name)
    raise AttributeError(name)
