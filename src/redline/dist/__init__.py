"""Using every GPU: launching workers, distributed strategies, sharded checkpoints, the hang watchdog."""
