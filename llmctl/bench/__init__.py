"""Load generator and latency/throughput metrics."""
