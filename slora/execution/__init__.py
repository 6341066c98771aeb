"""Running a step on the device: step batches, the model runner, graphs, backends, adapter weights."""
