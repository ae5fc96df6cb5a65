"""The k3 version (pyproject.toml's), importable without the rest of the package."""

__version__ = "0.1.0"
