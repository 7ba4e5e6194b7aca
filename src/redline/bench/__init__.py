"""Benchmarks of a Task: the naive loop, a matrix of settings and auto, timed side by side."""

from redline.bench.matrix import Setting, expand
from redline.bench.run import BenchResult, BenchRow, benchmark

__all__ = ["BenchResult", "BenchRow", "Setting", "benchmark", "expand"]
