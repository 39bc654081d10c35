"""The CUDA launch-plan rules (csrc/include/dflash/cuda/plans.h), evaluated on the host
through dflash_ext._C._cuda_plan: they are pure functions, so they are checked on every
machine, GPU or not. The per-architecture plan functions call them with their tile sizes
and measured occupancy (python_tests/cuda/host_checks.cu checks those compositions)."""
import itertools

import pytest

import dflash_ext._C as C

KEY_TILE = 64          # the attention kernel's key tile (block_attention.cuh)
MIN_KEYS = 256         # kAttnMinKeysPerSplit
MIN_K_TILES = 4        # kGemmMinKTilesPerSplit
H200_WAVE = 132 * 2    # 132 SMs x 2 resident CTAs


def covers_exactly(splits, per, units):
    # splits x per covers every unit, and the last split starts inside the range (none is empty)
    return splits >= 1 and per >= 1 and splits * per >= units and (splits - 1) * per < units


@pytest.mark.parametrize("ctas,units,min_units,max_splits,wave",
                         list(itertools.product([1, 7, 64, 264, 1000], [1, 3, 4, 33, 320, 5000], [1, 4], [1, 16, 128],
                                                [8, 264])))
def test_split_plan_covers_every_unit_once_and_respects_its_bounds(ctas, units, min_units, max_splits, wave):
    splits, per = C._cuda_plan("split", ctas, units, min_units, max_splits, wave)
    assert covers_exactly(splits, per, units)
    assert splits <= max_splits
    if splits > 1:
        assert per >= min_units, "a split shorter than the minimum"
        assert ctas * splits <= wave + ctas, "more CTAs than one wave needs"
    if ctas >= wave:
        assert splits == 1, "a grid that already fills the wave is split"


H200_SMS, H200_PER_SM = 132, 2  # block_attention's D = 128 tile: 88 KiB of shared memory, 2 per SM


def busiest_sm_tiles(ctas, splits, tiles, sms):
    # the plan's cost: resident CTAs on the busiest SM x key tiles per split
    return -(-ctas * splits // sms) * tiles


def test_attention_plan_keeps_long_splits_for_short_contexts():
    # Hkv = 8, Bq = 16, group 4 -> 8 CTAs, 2k context; an older rule made 33 splits of 64 keys.
    splits, tiles = C._cuda_plan("attention", 8, 2048 + 16, KEY_TILE, H200_SMS, H200_PER_SM)
    assert tiles * KEY_TILE >= MIN_KEYS
    assert splits <= (2048 + 16) // MIN_KEYS + 1
    assert covers_exactly(splits, tiles, -(-(2048 + 16) // KEY_TILE))


@pytest.mark.parametrize("max_keys", [1, 17, 255, 256, 257, 1024, 4096 + 16, 16384 + 16, 1 << 20])
@pytest.mark.parametrize("ctas", [1, 8, 64, 131, 132, 133, 512])
@pytest.mark.parametrize("sms,per_sm", [(132, 2), (132, 1), (108, 1), (148, 3), (4, 1)])
def test_attention_plan_splits(max_keys, ctas, sms, per_sm):
    splits, tiles = C._cuda_plan("attention", ctas, max_keys, KEY_TILE, sms, per_sm)
    key_tiles = -(-max_keys // KEY_TILE)
    assert covers_exactly(splits, tiles, key_tiles)
    assert splits == 1 or tiles * KEY_TILE >= MIN_KEYS
    assert splits <= 128
    assert splits == 1 or ctas * splits <= sms * per_sm, "the grid stays within one wave"
    # no other split count within those bounds has a less loaded busiest SM
    best = min(busiest_sm_tiles(ctas, -(-key_tiles // -(-key_tiles // s)), -(-key_tiles // s), sms)
               for s in range(1, 129) if s == 1 or (-(-key_tiles // s) * KEY_TILE >= MIN_KEYS
                                                    and ctas * s <= sms * per_sm))
    assert busiest_sm_tiles(ctas, splits, tiles, sms) == best


@pytest.mark.parametrize("context", [4096, 16384, 32768])
@pytest.mark.parametrize("Bq", [8, 16])
def test_attention_plan_of_qwen3_8b_fills_one_wave_of_an_h200(context, Bq):
    """The issue's shapes: 32 q / 8 KV heads, D = 128, Bq x 4 <= 64 rows -> 8 CTAs. From 16k on
    the grid is exactly one wave (33 splits, 264 CTAs = 2 per SM); at 4k the 256-key minimum
    allows 16 splits, and 13 of 320 keys load the busiest SM as much (fewer partials)."""
    splits, tiles = C._cuda_plan("attention", 8, context + Bq, KEY_TILE, H200_SMS, H200_PER_SM)
    assert covers_exactly(splits, tiles, -(-(context + Bq) // KEY_TILE))
    if context >= 16384:
        assert 8 * splits == H200_SMS * H200_PER_SM
    else:
        assert (splits, tiles) == (13, 5)


def test_attention_plan_avoids_a_ragged_second_resident_cta():
    # 8 CTAs x 17 splits = 136 CTAs on 132 SMs: 4 SMs would hold two and set the time.
    splits, tiles = C._cuda_plan("attention", 8, 17 * 4 * KEY_TILE, KEY_TILE, H200_SMS, H200_PER_SM)
    assert not (H200_SMS < 8 * splits <= H200_SMS + 8)
    assert busiest_sm_tiles(8, splits, tiles, H200_SMS) < busiest_sm_tiles(8, 17, 4, H200_SMS)


def test_attention_plan_does_not_split_a_full_grid():
    assert C._cuda_plan("attention", H200_SMS * H200_PER_SM, 1 << 20, KEY_TILE, H200_SMS, H200_PER_SM)[0] == 1


@pytest.mark.parametrize("ctas,k_tiles", [(18, 9), (80, 64), (32, 320), (1, 1), (264, 64), (2, 2)])
def test_gemm_split_plan(ctas, k_tiles):
    splits, per = C._cuda_plan("gemm", ctas, k_tiles, H200_WAVE)
    assert covers_exactly(splits, per, k_tiles)
    assert splits == 1 or per >= MIN_K_TILES
    assert splits == 1 or ctas * splits <= H200_WAVE, "a split grid past one wave (rounded up)"
    if ctas >= H200_WAVE:
        assert splits == 1


def test_inject_of_a_qwen3_8b_drafter_step_is_split():
    # 16 tokens -> one row tile; N=5 layers x (k, v) x Hkv=8 = 80 CTAs on 132 SMs; H=4096: 64 K tiles.
    splits, per = C._cuda_plan("gemm", 80, 64, H200_WAVE)
    assert splits >= 2 and covers_exactly(splits, per, 64)


GEMV_MAX_ROWS = 16     # kGemvMaxRows
GEMV_ROW_BLOCK, GEMV_STEP_K, GEMV_MIN_STEPS = 32, 32, 16  # kGemvRowBlock, kGemvStepK, kGemvMinStepsPerCta
LIBRARY, GEMV, TENSOR_CORES, SIMT = range(4)  # GemmPath


@pytest.mark.parametrize("T,rows,K,group", [
    (1, 4096, 5 * 4096, 4096), (16, 4096, 5 * 4096, 4096),       # Qwen3-8B project_features
    (4, 8192, 5 * 8192, 8192),                                    # hidden 8192
    (16, 5 * 2 * 8 * 128, 4096, 128),                             # Qwen3-8B inject_context_kv: a group per head
    (1, 90, 64, 90), (3, 40, 8, 40), (16, 1, 1, 1), (2, 4096, 64, 4096)])
@pytest.mark.parametrize("wave", [132, H200_WAVE, 4])
def test_gemv_plan_is_one_wave_of_whole_steps(T, rows, K, group, wave):
    ctas, row_blocks, k_steps, groups, partial_floats, counters = C._cuda_plan("gemv", T, rows, K, group, wave)
    steps = row_blocks * k_steps
    assert row_blocks == -(-rows // GEMV_ROW_BLOCK) and k_steps == -(-K // GEMV_STEP_K)
    assert 1 <= ctas <= wave, "more CTAs than one wave"
    assert ctas == 1 or steps // ctas >= GEMV_MIN_STEPS, "CTAs too short to pay for themselves"
    if steps >= wave * GEMV_MIN_STEPS:
        assert ctas == wave, "enough work for a full wave, but the grid is smaller"
    assert groups == (1 if group >= rows else row_blocks // (group // GEMV_ROW_BLOCK))
    assert counters == row_blocks + groups
    assert partial_floats == (ctas + row_blocks) * GEMV_ROW_BLOCK * T


def test_gemv_plan_of_the_qwen3_8b_step_fills_the_h200_exactly():
    # the old split-K plan made 288 or 320 CTAs for a 264-CTA wave
    assert C._cuda_plan("gemv", 16, 4096, 5 * 4096, 4096, H200_WAVE)[0] == H200_WAVE
    assert C._cuda_plan("gemv", 16, 5 * 2 * 8 * 128, 4096, 128, H200_WAVE)[0] == H200_WAVE


@pytest.mark.parametrize("steps,ctas", [(1, 1), (100, 7), (81920, 264), (64, 64), (1000, 132)])
def test_stream_cta_of_matches_the_ranges_the_kernel_walks(steps, ctas):
    # CTA c streams steps [c * steps // ctas, (c + 1) * steps // ctas)
    owner = [c for c in range(ctas) for _ in range(c * steps // ctas, (c + 1) * steps // ctas)]
    assert len(owner) == steps
    assert [C._cuda_plan("stream_cta", s, steps, ctas) for s in range(steps)] == owner


@pytest.mark.parametrize("T", [1, 2, 8, 9, 16, 17, 64, 4096])
def test_small_t_takes_the_gemv_and_prefill_takes_cublas(T):
    small = T <= GEMV_MAX_ROWS
    assert C._cuda_plan("project_path", 1, T) == (GEMV if small else LIBRARY)
    assert C._cuda_plan("project_path", 0, T) == LIBRARY  # fp32, unaligned or odd H: cuBLAS at any T
    assert C._cuda_plan("inject_path", 1, T) == (GEMV if small else TENSOR_CORES)
    assert C._cuda_plan("inject_path", 0, T) == SIMT


@pytest.mark.parametrize("max_context,window,S,expected", [
    (-1, 0, 1000, 1000), (-1, 128, 1000, 128), (300, 0, 1000, 300), (300, 128, 1000, 128),
    (5000, 0, 1000, 1000), (0, 0, 1000, 0), (-1, 0, 0, 0)])
def test_planned_context(max_context, window, S, expected):
    assert C._cuda_plan("planned_context", max_context, window, S) == expected


@pytest.mark.parametrize("cc,arch", [((7, 5), 0), ((8, 0), 80), ((8, 6), 80), ((8, 9), 80), ((9, 0), 90),
                                     ((10, 0), 100), ((10, 3), 100), ((11, 0), 80), ((12, 0), 80), ((12, 1), 80)])
def test_kernel_arch_dispatch_by_major_version(cc, arch):
    # B300 (10.3) runs the sm_100 code (not the sm_80 PTX); only 9.0 takes the wgmma kernels.
    assert C._cuda_plan("kernel_arch", *cc, 1 | 2 | 4) == arch  # all three sets built


@pytest.mark.parametrize("cc,compiled,arch", [((9, 0), 1, 80), ((10, 3), 1 | 2, 80), ((9, 0), 4, 0), ((8, 6), 2 | 4, 0),
                                              ((8, 6), 1, 80), ((12, 0), 4, 0), ((10, 0), 4, 100), ((7, 5), 7, 0)])
def test_kernel_arch_with_some_sets_built(cc, compiled, arch):
    # DFLASH_CUDA_ARCHS: a GPU whose own set was not built runs the sm_80 PTX, if that was built
    assert C._cuda_plan("kernel_arch", *cc, compiled) == arch


def test_the_build_reports_its_kernel_sets():
    from python_tests.helpers import load_setup_module

    setup = load_setup_module()
    d = setup.build_description()
    built = [a for a in setup.CUDA_ARCH_GENCODE if any(s.endswith(f"_{a}.cu") for s in d["cuda_sources"])]
    assert list(C._cuda_archs()) == built


def test_unknown_rule_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown plan rule"):
        C._cuda_plan("nope", 1)
