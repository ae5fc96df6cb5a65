"""Training: Per-Head Muon + AdamW (optim), WSD and context-length schedules (schedule)."""

from k3.threads import configure_openmp

configure_openmp()  # before torch loads libgomp (k3.threads): k3 train / k3 demo import this first
from k3.train.optim import (Muon, QKClip, build_optimizer, build_param_groups, describe_param_groups,  # noqa: E402
                            qk_clip_, zeropower_via_newtonschulz5)
from k3.train.schedule import ContextCurriculum, WSDSchedule  # noqa: E402

__all__ = ["Muon", "QKClip", "build_optimizer", "build_param_groups", "describe_param_groups", "qk_clip_",
           "zeropower_via_newtonschulz5", "WSDSchedule", "ContextCurriculum"]
