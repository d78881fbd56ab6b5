"""Benchmarks: measured side by side in one run, written to results/ with the command."""
