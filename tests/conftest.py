"""Session-wide test set-up: fast XLA compiles and one torch thread per test process.

The tests check values, not speed. XLA:CPU spends seconds optimising each gradient program, so
every compile in the session (and in the subprocesses tests start, which inherit the environment)
runs with backend optimisation off: the same HLO, the same buffer assignment and memory analysis,
about 4x faster to compile (Flax's own example tests set ``jax_disable_most_optimizations`` the
same way). This must happen before jax is first imported, hence at conftest import time.
A test that needs the optimised compile passes its own ``compiler_options``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.utils import FAST_COMPILE


def _fast_xla_environment() -> None:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # level 0, cheap LLVM passes
    flags = os.environ.get("XLA_FLAGS", "").split()
    option = "xla_cpu_use_fusion_emitters"  # not covered by the jax flag
    if not any(f.startswith(f"--{option}=") for f in flags):
        flags.append(f"--{option}={str(FAST_COMPILE[option]).lower()}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


_fast_xla_environment()
# No persistent compilation cache (the training CLI's and the planner's measuring worker's default,
# shared_configs.defaults): a cache hit compiles nothing, so an XLA dump a later test reads would be
# missing, and the tests would write to the user's cache.
os.environ.setdefault("UNET_REMAT_JAX_CACHE", "none")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """pytest -n 2 on a 2-core box: two test processes, so one intra-op thread each (more only contend)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The inner loop (`pytest -m "not slow" -n 2`) leaves out, besides the subprocess / torchrun / CLI
# tests marked in their files, the tests that took >= 2 s or so each on a 2-core box (XLA compiles of
# whole gradient programs, mostly): times from two `--durations` runs. Each area keeps a sibling in
# the inner loop (another policy, another spec, the torch half); CI runs all of them. Node-id
# prefixes, as pytest prints them.
COMPILE_HEAVY: frozenset[str] = frozenset(
    {
        "test_attention_chunk.py::test_chunked_gradients_equal_unchunked[full]",  # 13.7 s
        "test_attention_chunk.py::test_chunked_gradients_equal_unchunked[none]",  # 10.6 s
        "test_attention_chunk.py::test_chunked_outputs_match_torch[sd_linear_proj]",  # 8.0 s
        "test_attention_chunk.py::test_chunked_outputs_match_torch[tiny]",  # 5.2 s
        "test_attention_chunk.py::test_chunks_keep_the_scores_out_of_memory",  # 8.4 s
        "test_benchmarks_memory.py::test_torch_rows_add_up_and_agree_with_memtracker",  # 4.6 s
        "test_benchmarks_memory.py::test_xla_plan_adds_up_to_memory_analysis_and_matches_xla_own_peak",  # 23.4 s
        "test_caveats.py::test_flax_remat_updates_batch_stats_once[full]",  # 8.3 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[class_projection_variance]",  # 2.9 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[ddpm]",  # 2.5 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[mixed_attention]",  # 2.1 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[sd2_linear]",  # 5.4 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[sd]",  # 4.7 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[sdxl_depths]",  # 5.1 s
        "test_diffusers.py::test_flax_from_folder_matches_diffusers[sdxl_text_time]",  # 5.3 s
        "test_diffusers.py::test_to_diffusers_state_dict_loads_strictly[sdxl_depths]",  # 2.8 s
        "test_diffusers.py::test_to_diffusers_state_dict_loads_strictly[sdxl_text_time]",  # 2.4 s
        "test_diffusers_cache.py::test_flax_from_the_cache_matches_torch",  # 4.6 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-0]",  # 3.6 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-2]",  # 6.4 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-3]",  # 3.2 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-4]",  # 4.7 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-5]",  # 5.8 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DConditionModel-6]",  # 6.6 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DModel-0]",  # 2.7 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DModel-2]",  # 2.5 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DModel-3]",  # 2.6 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DModel-4]",  # 4.1 s
        "test_diffusers_random.py::test_flax_loads_and_matches[UNet2DModel-5]",  # 3.3 s
        "test_families.py::test_flax_remat_gives_the_plain_gradients[class_timestep_concat]",  # 14.2 s
        "test_families.py::test_flax_remat_gives_the_plain_gradients[sdxl_style]",  # 20.1 s
        "test_jax_unet.py::test_checkpointed_gradients_equal_plain[balanced]",  # 6.1 s
        "test_jax_unet.py::test_checkpointed_gradients_equal_plain[full]",  # 7.5 s
        "test_jax_unet.py::test_checkpointed_gradients_equal_plain[layers]",  # 8.0 s
        "test_jax_unet.py::test_parameter_count_matches_torch[sd15-859520964]",  # 2.3 s
        "test_jax_unet.py::test_parameter_count_matches_torch[sdxl-2567463684]",  # 4.7 s
        "test_jax_unet.py::test_parameter_paths_mirror_torch_state_dict[sdxl]",  # 4.7 s
        "test_jax_unet.py::test_remat_shrinks_saved_residuals",  # 4.8 s
        "test_parity.py::test_gradients_match[ddpm_style]",  # 11.3 s
        "test_parity.py::test_gradients_match[sd_linear_proj]",  # 12.2 s
        "test_parity.py::test_gradients_match[sdxl_style]",  # 2.9 s
        "test_parity.py::test_gradients_match[tiny]",  # 18.0 s
        "test_parity.py::test_outputs_match[sd21_style]",  # 4.9 s
        "test_parity.py::test_outputs_match[transformer_no_cross]",  # 7.9 s
        "test_plan_grammar.py::test_each_block_keeps_what_its_own_save_set_keeps[jax]",  # 5.4 s
        "test_plan_grammar.py::test_jax_grouped_plan_gradients_equal_plain",  # 25.3 s and 5.2 s (two of three)
        "test_plan_model.py::test_torch_predictions_match_the_benchmark_tracker",  # 5.7 s
        "test_plan_model.py::test_torch_profiles_specs_with_conditioning_inputs[class_cond]",  # 4.8 s
        "test_plan_model.py::test_torch_shapes_only_profile_equals_the_real_one",  # 5.9 s
        "test_selective.py::test_jax_offload_on_cpu_warns_and_saves_in_place",  # 28.0 s
        "test_selective.py::test_jax_selective_equals_plain",  # 10.4 s
        "test_train.py::test_checkpointing_keeps_the_loss_curve[jax]",  # 19.1 s
        "test_train.py::test_loss_halves_on_digits",  # 4.6 s
        "test_train.py::test_torch_and_jax_loss_curves_agree",  # 8.2 s
        "test_train_batchnorm.py::test_jax_batchnorm_curve_and_running_stats_match_torch",  # 10.5 s
        "test_train_batchnorm.py::test_jax_batchnorm_resume_continues_the_curve",  # 7.3 s
        "test_train_batchnorm.py::test_jax_batchnorm_samples_use_the_running_stats",  # 11.8 s with its fixture
        "test_train_conditioning.py::test_torch_and_jax_train_the_same_on_conditioned_batches[class_cond]",  # 4.9 s
        "test_train_conditioning.py::test_torch_and_jax_train_the_same_on_conditioned_batches[sdxl_style]",  # 9.6 s
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.removeprefix("tests/").startswith(tuple(COMPILE_HEAVY)):
            item.add_marker(pytest.mark.slow)
