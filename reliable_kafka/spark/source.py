"""The `reliable_kafka` Spark Python Data Source: df.write / spark.read / writeStream / readStream.format(...).

Options are validated on the driver before any task starts; an exactly_once write also checks, before
writing, whether its write id already completed (then every task only verifies its input).
"""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from reliable_kafka.errors import ConfigError
from reliable_kafka.spark.options import (
    EXACTLY_ONCE,
    STREAM_READER_OPTIONS,
    reader_options,
    stream_reader_options,
    writer_options,
)
from reliable_kafka.spark.reader import KafkaReader, schema_ddl
from reliable_kafka.spark.stream_reader import KafkaStreamReader
from reliable_kafka.spark.stream_writer import KafkaStreamArrowWriter, stream_writer_options
from reliable_kafka.spark.writer import KafkaArrowWriter, check_input_schema, prepare_write

FORMAT = "reliable_kafka"


class ReliableKafkaDataSource(DataSource):
    """Kafka sink (at_least_once / exactly_once) and read_committed batch source with Spark's Kafka columns."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        # Spark asks for the schema before it knows whether a batch or a stream reads: the stream's own
        # option names pass here, and reader() / streamReader() refuse what their side does not take.
        return schema_ddl(reader_options(self.options, extra_names=STREAM_READER_OPTIONS).include_headers)

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaReader(reader_options(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(stream_reader_options(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ConfigError("mode", "a Kafka topic is append-only: use mode('append')")
        options = writer_options(self.options)
        check_input_schema(schema, options)
        manifest = prepare_write(options) if options.guarantee == EXACTLY_ONCE else None
        return KafkaArrowWriter(options, manifest)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        # Spark calls it at the query's start and again on the driver for every batch's commit.
        if overwrite:
            raise ConfigError("outputMode", "a Kafka topic is append-only: use outputMode('append')")
        options = stream_writer_options(self.options)
        check_input_schema(schema, options)
        return KafkaStreamArrowWriter(options)
