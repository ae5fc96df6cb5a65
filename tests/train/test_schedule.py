import json
import math

import pytest
import torch

from k3.train.schedule import ContextCurriculum, WSDSchedule


def test_wsd_linear_values_at_key_steps():
    s = WSDSchedule(total_steps=100, warmup_steps=10, decay_steps=20, min_lr_ratio=0.1,
                    peak_lr=3e-3)
    assert s(0) == pytest.approx(0.1) and s(4) == pytest.approx(0.5) and s(9) == 1.0
    assert s(10) == 1.0 and s(79) == 1.0  # stable
    assert s(80) == pytest.approx(1 - (1 / 20) * 0.9)  # first decay step already decays
    assert s(89) == pytest.approx(1 - 0.5 * 0.9)
    assert s(99) == pytest.approx(0.1) and s(150) == pytest.approx(0.1)  # floor
    assert s.lr_at(50) == pytest.approx(3e-3) and s.lr_at(99) == pytest.approx(3e-4)
    vals = [s(t) for t in range(100)]
    assert all(b <= a for a, b in zip(vals[10:], vals[11:]))


def test_wsd_cosine_decay_midpoint_and_end():
    s = WSDSchedule(total_steps=40, warmup_steps=0, decay_steps=20, min_lr_ratio=0.0,
                    decay="cosine")
    assert s(0) == 1.0 and s(19) == 1.0
    p = (29 - 20 + 1) / 20
    assert s(29) == pytest.approx(0.5 * (1 + math.cos(math.pi * p)))
    assert s(29) == pytest.approx(0.5)
    assert s(39) == pytest.approx(0.0, abs=1e-12)


def test_wsd_is_a_lambdalr_factor_and_plain_data():
    s = WSDSchedule.from_fractions(50, warmup=0.1, decay=0.2, min_lr_ratio=0.2)
    assert (s.warmup_steps, s.decay_steps) == (5, 10)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s)
    seen = []
    for _ in range(50):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5 * s(t) for t in range(50)])
    assert WSDSchedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_wsd_rejects_bad_phases():
    with pytest.raises(ValueError, match="exceed"):
        WSDSchedule(total_steps=10, warmup_steps=6, decay_steps=5)
    with pytest.raises(ValueError, match="decay"):
        WSDSchedule(total_steps=10, decay="step")


def test_curriculum_lookup_at_stage_boundaries():
    c = ContextCurriculum([(0, 128), (100, 256), (300, 1024)])
    assert [c.seq_len_at(t) for t in (0, 99, 100, 299, 300, 10 ** 6)] == \
        [128, 128, 256, 256, 1024, 1024]
    assert c.max_seq_len == 1024
    assert ContextCurriculum.parse("0:128,100:256,300:1024") == c
    assert ContextCurriculum.from_list(json.loads(json.dumps(c.to_list()))) == c
    assert ContextCurriculum.constant(64).seq_len_at(5) == 64


@pytest.mark.parametrize("stages,msg", [([], "at least one"), ([(5, 64)], "step 0"),
                                        ([(0, 64), (0, 128)], "strictly"),
                                        ([(0, 0)], "seq_len")])
def test_curriculum_validation(stages, msg):
    with pytest.raises(ValueError, match=msg):
        ContextCurriculum(stages)
    with pytest.raises(ValueError, match="look like"):
        ContextCurriculum.parse("0-128")
