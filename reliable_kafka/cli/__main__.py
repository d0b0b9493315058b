"""`python -m reliable_kafka.cli`: the `reliable-kafka` command, for an environment without its script."""

from reliable_kafka.cli.main import main

main()
