"""HTTP service of slora (OpenAI-compatible routes, adapter admin, tenants, metrics)."""
