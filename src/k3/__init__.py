"""K3: the Kimi K3 architecture, training and inference stack in PyTorch."""

from k3.config import K3Config, get_preset, list_presets
from k3.version import __version__
__all__ = ["K3Config", "get_preset", "list_presets", "K3Model", "K3ForCausalLM", "from_pretrained",
           "save_pretrained", "generate", "__version__"]


def __getattr__(name):  # lazy: importing k3 must not build the model stack
    if name in ("K3Model", "K3ForCausalLM"):
        from k3.model import decoder
        return getattr(decoder, name)
    if name in ("from_pretrained", "save_pretrained"):  # k3.from_pretrained(dir), k3.save_pretrained(model, dir)
        from k3.checkpoint import pretrained
        return getattr(pretrained, name)
    if name == "generate":  # k3.generate(model, input_ids, max_new_tokens, ...): via k3.infer.Engine
        from k3.infer.generate import generate
        return generate
    raise AttributeError(name)
