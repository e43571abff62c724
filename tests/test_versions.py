"""Memory that follows the installed transformers: the trace tier prices the step of the
release it runs, and equals the real CPU run of that release.

CI runs this file on the newest stack (the default pass) and on the oldest supported one (the
compat pass, .ci/run), so the two branches below are each checked against a real run.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.job.spec import TrainingSpec
from hybridmem.models import load_config
from hybridmem.trace import compat, runner, scope
from test_trace import real_cpu_peak, tiny

pytestmark = pytest.mark.compat


def _peaks(spec) -> tuple[int, int]:
    tracker, _ = runner.trace(spec, load_config(spec.model))
    return int(tracker.live_curve(device_only=False).max()), real_cpu_peak(spec)


def test_unpadded_batch_mask_follows_the_installed_transformers(monkeypatch):
    # transformers 4.x's `find_packed_sequence_indices` returns its mask for every batch given
    # position_ids (4.57 masking_utils.py), so SDPA gets a materialised (B, 1, S, S) mask;
    # 5.x returns None for an unpadded batch and SDPA runs is_causal with no mask
    spec = tiny(precision="fp32", attn="sdpa", micro_batch=4, seq_len=128)
    installed = _peaks(spec)
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a, **k: None)
    without_mask = _peaks(spec)
    assert installed[0] == installed[1] and without_mask[0] == without_mask[1]  # trace == real
    mask = spec.micro_batch * spec.seq_len ** 2 * torch.bool.itemsize
    if compat.transformers_major() >= 5:
        assert installed[0] == without_mask[0]
    else:
        assert installed[0] - without_mask[0] >= mask


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_experts_need_transformers_5(model):
    # 4.x's experts pick their tokens by value (`torch.where`), which a trace cannot run
    why = scope.refusal(TrainingSpec(model=model, micro_batch=2, seq_len=64, precision="bf16"))
    if compat.transformers_major() >= 5:
        assert why is None
    else:
        assert "transformers>=5.0" in str(why)
