"""The mechanism: host memory, streams, a parameter's slot, scopes, the schedule, the engine and its hooks."""
