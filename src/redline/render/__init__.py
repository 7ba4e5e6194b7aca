"""Rendering results: the same result data as a terminal table or JSON."""
