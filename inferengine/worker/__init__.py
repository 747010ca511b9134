"""Device work: inputs from a `SchedulerOutput`, the forward pass, sampling, KV memory."""
