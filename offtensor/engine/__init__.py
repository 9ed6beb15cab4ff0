"""Layer 5, the engine of one wrapped model: the schedule, gradients to the host, what an op gets, writes
to masters, the module and tensor hooks that call it. Imports budget/ and below."""
