"""Inference: token sampling and cached autoregressive generation."""

from k3.infer.sample import generate, sample_next_token

__all__ = ["generate", "sample_next_token"]
