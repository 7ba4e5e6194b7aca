"""Make a Task fit its device: the largest batch that runs a real training step there (``search``)."""
