"""Load a trained run's model and tokenizer (what ``k3 sample``, ``k3 generate``, ``k3 serve`` and the
evaluation load).

``load_run_model(path)`` accepts a run directory (its current checkpoint, verified against the
manifest), a checkpoint folder itself, or a plain model directory (config.json + safetensors, with a
``tokenizer.json`` beside it). A run whose checkpoint fails verification is an error naming the
failing file, never "no checkpoint".
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_run_model", "check_prompt", "model_class_of"]


def load_run_model(path: str | Path, device: str = "cpu"):
    """(model, tokenizer) from a run directory, its checkpoint folder, or a model directory."""
    from k3.checkpoint.training import read_checkpoint

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "no run or checkpoint here", str(path))
    if not path.is_dir():
        raise NotADirectoryError(20, "expected a run or checkpoint directory", str(path))
    if (path / "trainer_state.pt").is_file() or (path / "config.json").is_file():
        return _load_folder(path.resolve(), device)  # a checkpoint pointer: pin the version now
    # a run directory: retried once if a concurrent save swaps the checkpoint mid-load
    return read_checkpoint(path, lambda ckpt: _load_folder(ckpt, device, verify=False))  # verified


def _load_folder(folder: Path, device: str, verify: bool = True):
    import torch

    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import Tokenizer
    from k3.errors import CheckpointError
    from k3.checkpoint.training import MANIFEST, load_trainer_state, verify_checkpoint

    by_manifest = (folder / MANIFEST).is_file()
    if verify and by_manifest:
        verify_checkpoint(folder)
    if (folder / "trainer_state.pt").is_file():
        model_dir, qat = folder / "model", load_trainer_state(folder)["train_config"].get("qat", False)
    else:
        model_dir, qat = folder, False
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path}: no tokenizer.json beside the model")
    # a run checkpoint's manifest already covers the model files; a bare model dir has its index hashes
    model = from_pretrained(model_dir, dtype=torch.float32, device=device, verify=verify and not by_manifest,
                            model_class=model_class_of(model_dir))
    if qat:  # the weights were trained through MXFP4 fake quantization: sample the same way
        from k3.train.qat import enable_qat
        enable_qat(model)
    model.eval()
    return model, Tokenizer.load(tok_path)


def model_class_of(model_dir: Path):
    """K3VLForConditionalGeneration for a checkpoint whose config has a vision tower, else None
    (from_pretrained's K3ForCausalLM): a vision checkpoint serves with its tower on every path."""
    from k3.config import K3Config
    from k3.model.multimodal import K3VLForConditionalGeneration

    config = K3Config.from_json(str(Path(model_dir) / "config.json"))
    return K3VLForConditionalGeneration if config.vision_config is not None else None


def check_prompt(ids: list[int], max_new_tokens: int, max_positions: int) -> None:
    """Reject a prompt before anything is printed: empty, or too long for the model."""
    from k3.errors import K3Error

    if not ids:
        raise K3Error("--prompt: the prompt is empty")
    if max_new_tokens < 0:
        raise K3Error(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if len(ids) + max_new_tokens > max_positions:
        raise K3Error(f"--prompt: {len(ids)} tokens + --max-new-tokens {max_new_tokens} exceeds the "
                      f"model's max_position_embeddings={max_positions}")
