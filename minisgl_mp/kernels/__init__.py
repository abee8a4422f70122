"""Native CPU kernels (C, built on first use) and their Python entry points: see `cpu.py`."""
