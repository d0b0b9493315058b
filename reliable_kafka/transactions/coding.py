"""The processor's deserializers and serializers, wrapped around the transform once, when it is built.

Guarantee: the transform sees its input decoded and its outputs leave encoded; when decoding, the transform
or encoding fails, the input holds its original bytes again, so a retry decodes from them and a dead-letter
copy carries exactly what was consumed. Without (de)serializers the transform is used as it is.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Message

from reliable_kafka.consumer.decoding import Decoding
from reliable_kafka.serdes import Encode, UserDeserializer, UserSerializer, decoder, encoder
from reliable_kafka.transactions.records import OutputRecord, Outputs, Transform, check_output, header_list


def coded(transform: Transform, *, value_deserializer: UserDeserializer | None,
          key_deserializer: UserDeserializer | None, value_serializer: UserSerializer | None,
          key_serializer: UserSerializer | None) -> Transform:
    """`transform` with the given (de)serializers around it, or `transform` itself when none is given.

    Decided here, once: a processor without them pays nothing per record. With them, each record costs
    one wrapper call plus the (de)serializers' own calls; a failure anywhere in it is the transform's
    failure (retried, then dead-lettered by the processor's failure stages).
    """
    decode_key, decode_value = decoder(key_deserializer, "key"), decoder(value_deserializer, "value")
    decoding = Decoding(decode_key, decode_value) if decode_key or decode_value else None
    # Only a field with a serializer is encoded: the other passes as the transform made it, as before.
    encode_value = encoder(value_serializer, "value") if value_serializer is not None else None
    encode_key = encoder(key_serializer, "key") if key_serializer is not None else None
    if decoding is None and encode_value is None and encode_key is None:
        return transform
    if encode_value is not None or encode_key is not None:
        transform = _encoding(transform, encode_value, encode_key)
    return transform if decoding is None else _decoding(transform, decoding)


def _decoding(transform: Transform, decoding: Decoding) -> Transform:
    decode = decoding.decode

    def decoded(msg: Message) -> Outputs:
        raw_key, raw_value = msg.key(), msg.value()
        try:
            decode(msg)
            outputs = transform(msg)
            # Run a generator now, while a failure can still give the record its bytes back.
            return outputs if outputs.__class__ is list or outputs.__class__ is tuple else list(outputs)
        except BaseException:
            # The original bytes again: the next attempt decodes from them, a dead-letter copy carries them.
            msg.set_key(raw_key)
            msg.set_value(raw_value)
            raise

    return decoded


def _encoding(transform: Transform, encode_value: Encode | None, encode_key: Encode | None) -> Transform:
    def encoded(msg: Message) -> Outputs:
        return [_encode(out, encode_value, encode_key) for out in transform(msg)]

    return encoded


def _encode(out: Any, encode_value: Encode | None, encode_key: Encode | None) -> OutputRecord:
    """A new OutputRecord with value and key encoded for its topic; bytes and None pass as they are.

    The serializer gets the output's header list and may add to it (a Schema Registry serializer's
    schema id header, say): the output is written with the list it saw.
    """
    check_output(out)
    headers = header_list(out.headers)
    value, key = out.value, out.key
    # The key first, as confluent's SerializingProducer does.
    if encode_key is not None and key is not None and key.__class__ is not bytes:
        key = encode_key(out.topic, key, headers)
    if encode_value is not None and value is not None and value.__class__ is not bytes:
        value = encode_value(out.topic, value, headers)
    # No headers given and none added: None, so the output keeps the cheap rk-id-only header path.
    return OutputRecord(out.topic, value, key, headers if headers or out.headers is not None else None,
                        out.partition)
