"""Tool use on CPU: a tiny model learns to call a calculator for sums it cannot do itself (see README.md)."""
