"""The Triton interpreter suites' kernel cases, run compiled on the GPU.

tests/test_triton_attention.py, test_triton_decode_attention.py, test_decode_word_tiles.py, test_triton_kv_write.py,
test_quant_triton.py, test_w4a16.py, test_w4a16_half2.py and test_w4a16_pairs.py choose CUDA when it is present;
importing their kernel tests here collects them under this module's `gpu` mark, so `pytest -m gpu tests/gpu` runs them
on the device.
(Their engine tests need the default model's tokenizer package, which the GPU machine lacks; test_triton_gpu.py and
e2e_check.py cover the engine there.)
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("triton")

from test_quant_triton import (  # noqa: E402,F401
    test_triton_gemm_matches_reference,
    test_triton_gemm_on_tool_checkpoints,
)
from test_decode_word_tiles import (  # noqa: E402,F401
    test_bf16_and_fp32_queries,
    test_caches_word_tiles_do_not_take_are_refused,
    test_every_byte_widens_to_its_fp16_value,
    test_head_dims_padded_to_a_power_of_two_and_the_prefetch,
    test_keys_major_over_bytes_and_16_bit_caches,
    test_sliding_window_and_stale_slots_are_never_read,
    test_word_tiles_match_torch_and_the_byte_path,
)
from test_triton_attention import (  # noqa: E402,F401
    test_both_paths_agree_with_float64_math,
    test_head_dim_128_and_fp32,
    test_matches_torch_path,
    test_never_reads_past_seq_len,
    test_with_hadamard_rotated_keys,
)
from test_triton_decode_attention import (  # noqa: E402,F401
    test_head_dims_single_pass_and_default_tiles,
    test_never_reads_past_seq_len_and_agrees_with_float64,
    test_replays_with_new_lengths_and_a_wider_table_without_host_data,
    test_sliding_window_never_reads_freed_blocks,
    test_split_partitions_match_torch,
)
from test_triton_kv_write import (  # noqa: E402,F401
    test_16_and_32_bit_writes_are_bit_exact,
    test_fp8_hardware_cast_path_within_one_exponent_step,
    test_fp8_writes_are_bit_exact,
    test_negative_slots_are_padding_and_not_written,
    test_out_of_range_values_clamp_to_the_largest_finite_fp8,
    test_strided_inputs_from_a_fused_projection,
)
from test_triton_layer_ops import (  # noqa: E402,F401
    test_engine_with_triton_layer_ops_generates_torch_ops_tokens,
    test_rms_norm_and_the_residual_add_match_torch,
    test_rope_matches_torch_on_dense_and_strided_heads,
    test_silu_and_mul_matches_torch,
    test_what_the_kernels_do_not_take_goes_to_torch_and_auto_picks_them_for_16_bit_cuda,
)
from test_w4a16 import (  # noqa: E402,F401
    test_awq_tool_checkpoint_through_decode_layout,
    test_decode_kernel_16bit_activations,
    test_decode_kernel_matches_reference,
    test_dense_path_by_column_chunks,
    test_split_k_partial_sums_and_dense_path,
    test_splitk_gemv_16bit_activations,
    test_splitk_gemv_matches_reference,
    test_splitk_last_reduction_leaves_workspace_zero_and_rule,
)
from test_w4a16_half2 import (  # noqa: E402,F401
    test_splitk_half2_fp16_sums_stay_finite_for_large_activations,
    test_splitk_half2_matches_reference,
    test_splitk_half2_takes_the_fp32_path_for_an_activation_two_bytes_off_alignment,
)
from test_w4a16_pairs import test_splitk_pairs_matches_reference  # noqa: E402,F401
