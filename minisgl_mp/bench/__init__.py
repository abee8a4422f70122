"""Benchmark helpers shared by `launch/bench_offline.py` and `launch/bench_serving.py`:
seeded workloads, the engine and Hugging Face runners, the decode floor, serving clients,
statistics, JSON reports and plots."""
