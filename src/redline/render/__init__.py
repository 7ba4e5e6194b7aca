"""Rendering results: the same result data as a terminal table, JSON, or a self-contained HTML page with charts."""
