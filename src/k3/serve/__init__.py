"""The OpenAI-compatible HTTP server (SPEC §6.4): ``k3 serve CKPT``; ``create_app`` in ``k3.serve.app``."""
