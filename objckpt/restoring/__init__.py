"""Restore: select target leaves, plan reads, land and scatter bytes, build the arrays."""
