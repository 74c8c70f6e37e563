"""The AES-GCM example codec on its own: values round-trip, nothing of them shows in the
bytes, the key id travels with each payload so keys can rotate, and every way a payload
or the key list can be wrong is refused with a message that names what to fix."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from hypothesis import given

from examples.aes_gcm_codec import (
    CONTENT_TYPE,
    NONCE_BYTES,
    AesGcmCodec,
    KeyConfigError,
    codec,
    new_key,
)
from stepstream import InvalidPayload, JsonCodec, Payload
from tests.json_values import json_values

K1 = ("k1", bytes(range(32)))
K2 = ("k2", bytes(range(100, 132)))
SECRET = {"card": "4242-SECRET", "note": "naïve ✓"}


def env(*keys: tuple[str, bytes]) -> dict[str, str]:
    return {
        "STEPSTREAM_CODEC_KEYS": ",".join(f"{k}:{base64.b64encode(v).decode()}" for k, v in keys)
    }


@given(json_values())
def test_every_json_value_round_trips(value: Any) -> None:
    sealed = AesGcmCodec([K1])
    payload = sealed.encode(value)
    assert payload.content_type == f"{CONTENT_TYPE}; key-id=k1"
    assert sealed.decode(payload) == JsonCodec().decode(JsonCodec().encode(value))


def test_the_bytes_hold_no_plaintext_and_a_fresh_nonce_each_time() -> None:
    sealed = AesGcmCodec([K1])
    first, second = sealed.encode(SECRET), sealed.encode(SECRET)
    assert b"SECRET" not in first.data and "naïve".encode() not in first.data
    assert first.data[:NONCE_BYTES] != second.data[:NONCE_BYTES]
    assert first.data != second.data
    # nonce + ciphertext (as long as the JSON) + 16-byte tag
    assert len(first.data) == NONCE_BYTES + len(JsonCodec().encode(SECRET).data) + 16


def test_payloads_written_before_encryption_still_read() -> None:
    assert AesGcmCodec([K1]).decode(JsonCodec().encode(SECRET)) == SECRET


def test_rotation_reads_old_keys_writes_with_the_first_and_names_a_missing_one() -> None:
    old = AesGcmCodec([K1]).encode(SECRET)
    rotated = AesGcmCodec([K2, K1])
    assert rotated.decode(old) == SECRET
    new = rotated.encode(SECRET)
    assert new.content_type.endswith("key-id=k2")
    only_new = AesGcmCodec([K2])
    assert only_new.decode(new) == SECRET
    with pytest.raises(InvalidPayload) as refused:
        only_new.decode(old)
    message = str(refused.value)
    assert "key id 'k1'" in message and "it has k2" in message
    assert "add k1:BASE64KEY to STEPSTREAM_CODEC_KEYS" in message


def test_a_relabelled_or_altered_payload_does_not_authenticate() -> None:
    both = AesGcmCodec([K1, K2])
    payload = both.encode(SECRET)
    relabelled = Payload(payload.content_type.replace("k1", "k2"), payload.data)
    with pytest.raises(InvalidPayload, match="does not authenticate under key id 'k2'"):
        both.decode(relabelled)
    flipped = bytes([payload.data[-1] ^ 1])
    with pytest.raises(InvalidPayload, match="or the record was altered"):
        both.decode(Payload(payload.content_type, payload.data[:-1] + flipped))
    # The same key id under another key (a key replaced rather than rotated).
    with pytest.raises(InvalidPayload, match="is not the one that wrote it"):
        AesGcmCodec([("k1", K2[1])]).decode(payload)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (Payload("application/x-other", b"x"), "this codec reads"),
        (Payload(CONTENT_TYPE, b"x" * 40), "this codec reads"),  # no key id
        (Payload(f"{CONTENT_TYPE}; key-id=k1", b"short"), "too short to hold a nonce"),
    ],
)
def test_payloads_it_cannot_read_are_refused_saying_why(payload: Payload, expected: str) -> None:
    with pytest.raises(InvalidPayload, match=expected):
        AesGcmCodec([K1]).decode(payload)


def test_keys_come_from_the_environment_the_first_encrypting() -> None:
    made = AesGcmCodec.from_env(env(K2, K1))
    assert made.key_ids == ["k2", "k1"]
    assert made.encode(1).content_type.endswith("key-id=k2")


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ("", "STEPSTREAM_CODEC_KEYS is not set"),
        ("k1", "'k1' is not KEYID:BASE64KEY"),
        ("k1:not base64!", "the key of 'k1' in STEPSTREAM_CODEC_KEYS is not base64"),
        (f"k1:{base64.b64encode(b'short').decode()}", "key 'k1' is 5 bytes"),
        (env(K1, K1)["STEPSTREAM_CODEC_KEYS"], "key id 'k1' is listed twice"),
        (f"a=b:{base64.b64encode(bytes(32)).decode()}", "key id 'a=b' must be"),
    ],
)
def test_a_bad_key_list_says_how_to_fix_it(keys: str, expected: str) -> None:
    with pytest.raises(KeyConfigError, match=expected) as refused:
        AesGcmCodec.from_env({"STEPSTREAM_CODEC_KEYS": keys})
    if "is not set" in expected:
        assert "python -m examples.aes_gcm_codec KEYID" in str(refused.value)


def test_the_factory_reads_the_environment_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPSTREAM_CODEC_KEYS", raising=False)
    with pytest.raises(KeyConfigError):
        codec()
    entry = new_key("k9")
    monkeypatch.setenv("STEPSTREAM_CODEC_KEYS", entry)
    made = codec()
    assert made.key_ids == ["k9"]
    assert len(base64.b64decode(entry.split(":", 1)[1])) == 32
    assert made.decode(made.encode(SECRET)) == SECRET
