"""Local multi-node testnets, scenarios and benchmarks."""
