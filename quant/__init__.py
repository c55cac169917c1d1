"""pagedserve.quant: quantization methods (unquantized, GPTQ, AWQ) behind one linear-layer interface."""
