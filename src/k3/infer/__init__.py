"""Inference: token sampling and cached autoregressive generation."""

from k3.infer.run_model import load_run_model, sample_main
from k3.infer.sample import generate, sample_next_token

__all__ = ["generate", "sample_next_token", "load_run_model", "sample_main"]
