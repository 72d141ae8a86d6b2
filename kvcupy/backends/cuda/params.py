"""The attention kernels' parameters (kernels_cu/params.cuh, KVC_ATTENTION_FIELDS:
the fields of `Params`) as one field list: names in order and launch.py's type
codes. The launcher fills them by name (fields a kernel does not read stay
zero) and packs them into one buffer. tests/cpu/test_cuda_launch.py holds the
names and types equal to the header's; tests/jit/test_kernel_constants.py
compiles a static_assert of every offset.
"""

from __future__ import annotations

from .launch import ParameterStruct

ATTENTION_PARAMS = ParameterStruct((
    ("query", "P"), ("key_cache", "P"), ("value_cache", "P"), ("k_scales", "P"), ("v_scales", "P"),
    ("k_block_stride", "q"), ("k_slot_stride", "q"), ("k_head_stride", "q"),
    ("v_block_stride", "q"), ("v_slot_stride", "q"), ("v_head_stride", "q"),
    ("ks_block_stride", "q"), ("ks_slot_stride", "q"), ("ks_head_stride", "q"),
    ("vs_block_stride", "q"), ("vs_slot_stride", "q"), ("vs_head_stride", "q"),
    ("block_table", "P"), ("seq_lens", "P"), ("cu_seqlens_q", "P"), ("tiles", "P"),
    ("part_out", "P"), ("part_stats", "P"),
    ("num_tokens", "i"), ("num_heads", "i"), ("group", "i"), ("head_size", "i"), ("row_bytes", "i"),
    ("block_size", "i"), ("block_shift", "i"), ("num_blocks", "i"), ("table_width", "i"),
    ("split_tokens", "i"), ("window", "i"), ("softcap", "f"), ("code_unit", "f"),
    # The prefill kernel's own input and output.
    ("query_in", "P"), ("q_token_stride", "q"), ("q_head_stride", "q"), ("query_dtype", "i"),
    ("rotation_fwd", "P"), ("rotation_inv", "P"), ("rotation_shift", "i"), ("rotation_stages", "i"),
    ("query_factor", "f"), ("out_factor", "f"),
    ("out", "P"), ("out_token_stride", "q"), ("out_head_stride", "q"), ("out_dtype", "i"),
    ("sinks", "P"), ("direct", "i"),
    # The decode kernel's in-kernel query rotation.
    ("signs", "P"), ("sign_shift", "i"),
))
