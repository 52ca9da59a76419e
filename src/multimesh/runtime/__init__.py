"""The runtime: compile a plan's fragments and dispatch them in plan order."""
