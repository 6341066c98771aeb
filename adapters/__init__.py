"""PEFT LoRA adapters: validation, loading (safetensors only), packing into the pool layout, registry."""
