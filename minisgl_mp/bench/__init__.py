"""The benchmarks, one module per `python -m minisgl_mp.bench` subcommand (see __main__.py),
and what they share: seeded workloads, the engine and Hugging Face runners, the decode floor,
serving clients, statistics, JSON reports and plots."""
