pytest_plugins = [
    "tests.fixtures.kafka",
    "tests.fixtures.redis",
]
