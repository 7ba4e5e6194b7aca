"""Make it fit: estimate a step's memory before the run, find the largest batch, recover from out-of-memory."""
