"""The `reliable-kafka` command line: local cluster, loss lab, benchmarks, doctor and outbox tools."""
