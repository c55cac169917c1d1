"""LoRA adapters over one base model: PEFT folders loaded at start or at runtime, picked per request, several in one
step (docs/lora.md)."""
