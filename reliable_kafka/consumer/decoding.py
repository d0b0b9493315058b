"""Decode stage: a record's key and value bytes become the deserializers' objects before the handler runs.

Guarantee: a record that cannot be decoded is treated as a failing handler (retried, then dead-lettered)
and, whenever a handler attempt fails, the record holds its original bytes again, so a retry decodes
from them and the dead-letter topic receives exactly what was consumed.
"""

from __future__ import annotations

from confluent_kafka import Message

from reliable_kafka.consumer.work import AsyncHandler, BatchHandler, Handler
from reliable_kafka.errors import DeserializationError
from reliable_kafka.serdes import Decode


class Decoding:
    """The consumer's key and value deserializers (serdes.decoder), applied in place on the Message.

    Why in place: the handler contract stays "a confluent Message"; msg.key() / msg.value() return the
    decoded objects, as with confluent-kafka's DeserializingConsumer. Built only when a deserializer
    is given, so a consumer without one pays nothing per record.
    """

    def __init__(self, key: Decode | None, value: Decode | None) -> None:
        assert key is not None or value is not None
        self._key = key
        self._value = value

    def decode(self, msg: Message) -> None:
        """Decode `msg` in place; on DeserializationError it keeps its original bytes."""
        raw_key, raw_value = msg.key(), msg.value()
        topic, headers = msg.topic(), msg.headers()
        assert topic is not None
        try:
            # The key first, as confluent's consumer does: a Schema Registry key deserializer may leave
            # state for the value's.
            if self._key is not None:
                msg.set_key(self._key(topic, raw_key, headers))
            if self._value is not None:
                msg.set_value(self._value(topic, raw_value, headers))
        except DeserializationError as exc:
            msg.set_key(raw_key)
            exc.partition = msg.partition()
            raise

    def handler(self, handler: Handler) -> Handler:
        """`handler`, called with the record decoded; a failed attempt leaves the record as consumed."""
        decode = self.decode

        def decoded(msg: Message) -> object:
            raw_key, raw_value = msg.key(), msg.value()
            try:
                decode(msg)
                return handler(msg)
            except BaseException:
                _restore(msg, raw_key, raw_value)
                raise

        return decoded

    def async_handler(self, handler: AsyncHandler) -> AsyncHandler:
        """handler() for an async handler: decoded on the loop before each attempt (keep deserializers
        quick, as in aiokafka), restored when the attempt fails."""
        decode = self.decode

        async def decoded(msg: Message) -> object:
            raw_key, raw_value = msg.key(), msg.value()
            try:
                decode(msg)
                return await handler(msg)
            except BaseException:
                _restore(msg, raw_key, raw_value)
                raise

        return decoded

    def batch_handler(self, batch_handler: BatchHandler) -> BatchHandler:
        """`batch_handler`, called with every record of the batch decoded; on failure all are restored."""
        decode = self.decode

        def decoded(msgs: list[Message]) -> object:
            raw = [(m.key(), m.value()) for m in msgs]
            try:
                for m in msgs:
                    decode(m)
                return batch_handler(msgs)
            except BaseException:
                for m, (raw_key, raw_value) in zip(msgs, raw, strict=True):
                    _restore(m, raw_key, raw_value)
                raise

        return decoded


def _restore(msg: Message, key: object, value: object) -> None:
    # The original bytes again: the next attempt decodes from them, and a dead-letter copy carries them.
    msg.set_key(key)
    msg.set_value(value)
