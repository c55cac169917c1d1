"""bench_check.py's decode-attention section: every decode path on Llama-3-8B-shaped layers, and a tile sweep.

For each KV dtype (fp16, FP8, int8) and (batch, context), one decode batch (benchmarks/attention_kernel.py's build
and byte count) is timed through
- `unified`: the prefill/mixed kernel (kernels/triton_attention.py), one program per sequence and KV head;
- `single_pass`: the decode kernel (kernels/triton_decode_attention.py) with one partition, no reduce;
- `split`: the decode kernel with the engine's partition count (at least 2, so small shapes exercise the reduce);
- at two shapes (64 x 4k and 16 x 16k on the GPU; the dry run's shorter one), the split path with other tiles, warp
  counts, pipeline stages, the prefetch and, for the 8-bit caches, word tiles and the keys-major step
  (`split_tile<N>_w<W>[_s<S>][_prefetch][_words][_kmajor]`): what to set the defaults by.
The row's own `ms`, `gb_s` and `fraction_of_copy` are the path the engine takes for that shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import attention_kernel

# (tile tokens, warps, prefetch, pipeline stages or None for the rule's, word tiles, keys major) beside the default
# (no prefetch; at head_dim 128: fp16 64 tokens and 4 warps, FP8 128 and 4, int8 64 and 8): the previous defaults and
# their neighbours, and one stage for the 8-bit caches, whose sm_90 code has 12-14% fewer instructions a KV byte
# without the async-copy pipeline (benchmarks/decode_attention_sass.py: an 8-bit tile is read back from shared memory
# a byte at a time); word tiles (kernels/triton_decode_words.py), which avoid those byte reads, alone and with the
# keys-major step (kernels/triton_decode_keys_major.py): lane-instructions a KV byte at 128 tokens, 4 warps, one
# stage FP8 2.41 and 2.07 (default 4.42), int8 3.47 and 3.10 (default 10.06); with the rule's stages the words are
# copied ahead asynchronously (FP8 2.42, int8 3.43, with keys major).
SWEEP = {"fp16": ((64, 8, False, None, False, False), (128, 4, False, None, False, False),
                  (32, 4, False, None, False, False), (64, 4, False, 1, False, False)),
         "fp8": ((128, 8, False, None, False, False), (64, 4, False, None, False, False),
                 (128, 4, False, 1, False, False), (64, 4, False, 1, False, False), (128, 4, False, 1, True, False),
                 (128, 4, False, None, True, False), (128, 4, False, 1, True, True), (128, 4, False, None, True, True),
                 (64, 4, False, 1, True, True)),
         "int8": ((64, 4, False, None, False, False), (128, 8, False, None, False, False),
                  (64, 8, False, 1, False, False), (128, 4, False, 1, False, False), (128, 4, False, 1, True, False),
                  (64, 8, False, 1, True, False), (128, 4, False, 1, True, True), (128, 4, False, None, True, True),
                  (64, 4, False, 1, True, True))}


def _path_row(ms: float, nbytes: int, copy: float) -> dict:
    gb_s = nbytes / (ms * 1e-3) / 1e9
    return {"ms": round(ms, 4), "gb_s": round(gb_s, 1), "fraction_of_copy": round(gb_s / copy, 3)}


def _paths(query, layer, meta, scale: float, partitions: int, sweep: tuple) -> dict[str, Callable[[], torch.Tensor]]:
    from pagedserve.kernels.triton_attention import triton_paged_attention
    from pagedserve.kernels.triton_decode_attention import triton_decode_attention

    paths = {
        "unified": lambda: triton_paged_attention(query, layer, meta, scale),
        "single_pass": lambda: triton_decode_attention(query, layer, meta, scale, num_partitions=1),
        "split": lambda: triton_decode_attention(query, layer, meta, scale, num_partitions=max(2, partitions)),
    }
    for tile, warps, prefetch, stages, words, keys_major in sweep:
        name = (f"split_tile{tile}_w{warps}{f'_s{stages}' if stages else ''}{'_prefetch' if prefetch else ''}"
                f"{'_words' if words else ''}{'_kmajor' if keys_major else ''}")
        launch = dict(num_partitions=max(2, partitions), tile_n=tile, num_warps=warps, prefetch=prefetch,
                      num_stages=stages, word_tiles=words, keys_major=keys_major)
        paths[name] = lambda launch=launch: triton_decode_attention(query, layer, meta, scale, **launch)
    return paths


def decode_case(case: attention_kernel.Case, copy: float, time_ms: Callable[[Callable], float], sweep: tuple) -> dict:
    from pagedserve.kernels.triton_decode_attention import decode_partitions

    query, layer, meta = attention_kernel.build(case, torch.float16)
    nbytes = attention_kernel.bytes_moved(case, query, meta)
    partitions = decode_partitions(case.batch, case.num_kv_heads, meta.block_tables.shape[1] * case.block_size)
    paths = _paths(query, layer, meta, case.head_dim**-0.5, partitions, sweep)
    row: dict = {"partitions": partitions, "engine_path": "split" if partitions > 1 else "single_pass", "paths": {}}
    reference = None
    for name, run in paths.items():  # unified first: its output is the reference
        # The timed calls' last output is compared, not one more call: the dry run's interpreter takes seconds a call.
        last = {}
        timed = _path_row(time_ms(lambda run=run, last=last: last.update(out=run())), nbytes, copy)
        out = last["out"].float()
        reference = out if reference is None else reference
        timed["max_abs_diff_vs_unified"] = round((out - reference).abs().max().item(), 5)
        row["paths"][name] = timed
    row.update({k: row["paths"][row["engine_path"]][k] for k in ("ms", "gb_s", "fraction_of_copy")})
    return row


def decode_attention_rows(device: str, shapes, heads: tuple[int, int, int], fp8: str, copy: float,
                          time_ms: Callable[[Callable], float], sweep_shapes: tuple[int, ...]) -> list[dict]:
    """One row per KV dtype and (batch, context), the tile sweep at the shapes `sweep_shapes` indexes; failures
    (out of memory, ...) become rows with an `error`."""
    rows = []
    num_heads, kv_heads, head_dim = heads
    for kv, sweep_key in (("fp16", "fp16"), (fp8, "fp8"), ("int8", "int8")):
        for index, (batch, context) in enumerate(shapes):
            case = attention_kernel.Case("triton", device, kv, batch, context, num_heads, kv_heads, head_dim, 16)
            sweep = SWEEP[sweep_key] if index in sweep_shapes else ()
            head = {"kv_dtype": kv, "batch": batch, "context": context}
            try:
                rows.append({**head, **decode_case(case, copy, time_ms, sweep)})
            except Exception as exc:  # out of memory, an unsupported dtype: reported, the rest still run
                rows.append({**head, "error": f"{type(exc).__name__}: {exc}"[:300]})
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows
