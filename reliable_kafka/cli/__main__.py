"""`python -m reliable_kafka.cli`: the `reliable-kafka` command, for an environment without its script."""

from reliable_kafka.cli.main import main

if __name__ == "__main__":  # importing the module (a walk over the package's modules) runs nothing
    main()
