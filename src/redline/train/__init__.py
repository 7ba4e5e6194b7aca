"""Training loops written for the user: the first-version loop behind `redline train`."""
