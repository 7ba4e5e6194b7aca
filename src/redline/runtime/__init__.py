"""Running the user's own loop fast: devices, precision, compile, data loading, and the Runtime."""
