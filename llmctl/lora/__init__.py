"""Multi-LoRA serving: PEFT adapters beside the base model, many in one batch (docs/server.md)."""
