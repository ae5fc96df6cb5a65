"""k3's configurations (SPEC §2, §3.9): one import for what the rest of k3 uses.

* :mod:`k3.config.model`: ``K3Config``, the text model's schema and validation;
* :mod:`k3.config.hf`: the ``config.json`` shapes it reads and writes (flat, transformers, the
  ``kimi_k3`` wrapper);
* :mod:`k3.config.vision`: ``VisionConfig`` (the released tower and projector) and the image size
  rule;
* :mod:`k3.config.presets`: the named configurations;
* :mod:`k3.config.checks`: the value checks every config and CLI validates with.

The modules import each other in that order upwards (checks ← hf ← model, checks ← vision,
model + vision ← presets) and never this package, so the package has no import cycle.
"""

from k3.config.checks import (INT_MAX, MAX_LAYERS, check_bool, check_choice, check_float, check_int, did_you_mean,
                              refuse_unknown)
from k3.config.hf import DEFAULT_WRAPPER, config_to_dict, wrap_text_config
from k3.config.model import K3Config, LinearAttnConfig, k3_layer_split
from k3.config.presets import PRESETS, get_preset, list_presets, vision_preset
from k3.config.vision import (RELEASE_VISION_CONFIG, ROPE_THETA, TOWER_NORM_EPS, ImageProcConfig, VisionConfig,
                              vision_config_of)
from k3.errors import ConfigError

__all__ = ["K3Config", "LinearAttnConfig", "k3_layer_split", "PRESETS", "get_preset", "list_presets",
           "vision_preset", "VisionConfig", "ImageProcConfig", "vision_config_of", "RELEASE_VISION_CONFIG",
           "TOWER_NORM_EPS", "ROPE_THETA", "config_to_dict", "wrap_text_config", "DEFAULT_WRAPPER", "check_int",
           "check_float", "check_bool", "check_choice", "refuse_unknown", "did_you_mean", "INT_MAX", "MAX_LAYERS",
           "ConfigError"]
