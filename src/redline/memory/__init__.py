"""Make it fit: estimate a step's memory before the run (``estimate``, ``fit``), and find the largest batch
that runs a real training step on the device (``search``)."""
