"""Checkpoints that survive a crash at any moment: one directory layout, two formats (whole and sharded)."""
