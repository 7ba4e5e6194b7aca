"""Using every GPU: the worker's environment, collectives, DDP/FSDP2 wrapping, the hang watchdog."""
