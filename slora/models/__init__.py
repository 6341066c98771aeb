"""Model code of slora: our own implementations over the unified paged pool."""
