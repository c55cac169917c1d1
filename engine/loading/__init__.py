"""pagedserve.engine.loading: `--model` / `--tokenizer` -> a built model and tokenizer (model store, HF and GGUF
checkpoints, the architecture and quant registries' lookups, the tokenizer and chat template)."""
