"""`AllocatorConfig`: PYTORCH_CUDA_ALLOC_CONF parsing and checks, as `AllocatorConfig.cpp` does."""

from __future__ import annotations

import pytest

from hybridmem.errors import SpecError
from hybridmem.allocator import AllocatorConfig, division_table

MiB = 1 << 20


def test_empty_or_missing_env_gives_pytorch_defaults():
    for value in (None, "", "  "):
        config = AllocatorConfig.from_env(value)
        assert config == AllocatorConfig()
    # AllocatorConfig.h defaults: max_split_size = SIZE_MAX, max_non_split_rounding = kLargeBuffer.
    assert AllocatorConfig().max_split_size() > 2**60
    assert AllocatorConfig().max_non_split_rounding_size() == 20 * MiB
    assert AllocatorConfig().large_segment_size() == 20 * MiB


def test_from_env_reads_every_modelled_key():
    config = AllocatorConfig.from_env(
        "max_split_size_mb:128, max_non_split_rounding_mb:30,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True,"
        "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False")
    assert config.max_split_size_mb == 128
    assert config.max_split_size() == 128 * MiB
    assert config.max_non_split_rounding_size() == 30 * MiB
    assert config.garbage_collection_threshold == 0.6
    assert config.roundup_power2_divisions == {256: 1, 512: 2, ">": 4}
    assert config.expandable_segments is True


def test_division_table_matches_pytorchs_own_config_test():
    # c10/test/core/AllocatorConfig_test.cpp: "roundup_power2_divisions:[64:8,128:2,256:4,512:2,
    # 1024:4,>:1]" gives divisions(32 MiB) = 8, (64) = 8, (128) = 2, (256) = 4, (512) = 2.
    # Interval index = log2(size) - 20 (kRoundUpPowerOfTwoStart = 1 MiB).
    table = division_table(AllocatorConfig.from_env(
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]").roundup_power2_divisions)
    assert [table[i] for i in (5, 6, 7, 8, 9, 10, 11, 15)] == [8, 8, 2, 4, 2, 4, 1, 1]


def test_scalar_divisions_apply_to_every_interval():
    assert division_table(4) == (4,) * 16
    assert division_table(None) == (0,) * 16


@pytest.mark.parametrize(("env", "match"), [
    ("max_split_size_mb:10", r"max_split_size_mb=10: must be a number >= 20"),  # parseMaxSplitSize
    ("max_non_split_rounding_mb:5", r"max_non_split_rounding_mb=5"),
    ("roundup_power2_divisions:3", r"power of 2"),  # parseRoundUpPower2Divisions
    ("roundup_power2_divisions:[100:2]", r"interval 100 must be a power of 2"),
    ("roundup_power2_divisions:[128:3]", r"divisions 3 must be 0 or a power of 2"),
    ("garbage_collection_threshold:1.5", r"must be in \(0.0, 1.0\)"),
    ("expandable_segments:yes", r"expandable_segments='yes' is not valid \(valid: True, False\)"),
    ("backend:cudaMallocAsync", r"only the native caching allocator is simulated"),
    ("max_split_mb:128", r"unknown allocator option \(valid: .*max_split_size_mb"),
    ("max_split_size_mb", r"expected ':'"),
    ("max_split_size_mb:abc", r"expected a number"),
])
def test_bad_config_strings_raise_spec_errors(env, match):
    with pytest.raises(SpecError, match=match):
        AllocatorConfig.from_env(env)


def test_bad_field_values_raise_spec_errors():
    with pytest.raises(SpecError, match="max_split_size_mb=1"):
        AllocatorConfig(max_split_size_mb=1)
    with pytest.raises(SpecError, match="roundup_power2_divisions"):
        AllocatorConfig(roundup_power2_divisions="4")
    with pytest.raises(SpecError, match="large_segment_size_mb=3"):
        AllocatorConfig(large_segment_size_mb=3)


def test_from_environ_prefers_pytorch_alloc_conf():
    # AcceleratorAllocatorConfig::instance reads PYTORCH_ALLOC_CONF, then PYTORCH_CUDA_ALLOC_CONF.
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_environ(both) == AllocatorConfig(expandable_segments=True)
    legacy = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert AllocatorConfig.from_environ(legacy) == AllocatorConfig(max_split_size_mb=64)
    assert AllocatorConfig.from_environ({}) == AllocatorConfig()
