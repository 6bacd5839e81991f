"""llmctl's benchmarks, run as modules from the checkout's root: ``python -m benchmarks.<folder>.<script>``
(docs/benchmarks.md lists them and what they found)."""
