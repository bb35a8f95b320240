"""skyrl-sdk benchmark suite: ``python -m benchmarks.run [--smoke] [--only NAME] [--json]``.

See docs/performance.md for what each benchmark measures and the latest numbers.
"""
