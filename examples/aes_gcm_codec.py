"""A payload codec that encrypts: every payload JSON, then sealed with AES-GCM (the
``cryptography`` package), under a key id so that keys can be rotated.

Keys come from ``STEPSTREAM_CODEC_KEYS``: ``KEYID:BASE64KEY`` pairs, comma-separated,
the first one encrypting and every one decrypting. A key is 16, 24 or 32 random bytes
(32: AES-256). Make one with ``python -m examples.aes_gcm_codec KEYID``.

Each encrypted payload says how to read it: its content type names the key id
(``application/vnd.stepstream.aes-gcm+json; key-id=k2``) and its data is a fresh 12-byte
nonce followed by the ciphertext and tag. The content type is authenticated too, so a
record cannot be relabelled with another key id. Rotation: put the new key first
(``k2:...,k1:...``); new payloads are sealed under k2, and records written under k1 stay
readable for as long as k1 is listed. Payloads written as plain JSON (before encryption
was turned on) still read.

    STEPSTREAM_CODEC_KEYS="k1:$(python -m examples.aes_gcm_codec --bare)" \\
        stepstream run examples.order:order --codec examples.aes_gcm_codec:codec
"""

from __future__ import annotations

import base64
import binascii
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from stepstream import InvalidPayload, JsonCodec, Payload

CONTENT_TYPE = "application/vnd.stepstream.aes-gcm+json"
KEYS_ENV = "STEPSTREAM_CODEC_KEYS"
NONCE_BYTES = 12
_KEY_SIZES = (16, 24, 32)
_JSON = "application/json"
_FORBIDDEN_IN_IDS = frozenset(",:;= \t\r\n\"'")
_KEYS_HINT = (
    f"set {KEYS_ENV} to KEYID:BASE64KEY pairs, comma-separated, the encrypting key first "
    "(e.g. k2:...,k1:...); make a key with `python -m examples.aes_gcm_codec KEYID`"
)


class KeyConfigError(ValueError):
    """``STEPSTREAM_CODEC_KEYS`` is missing or malformed; the message says how to fix it."""


class AesGcmCodec:
    """JSON values, encrypted with AES-GCM under the first of ``keys`` (key id, key),
    decrypted with whichever key the payload names."""

    def __init__(self, keys: Sequence[tuple[str, bytes]]) -> None:
        if not keys:
            raise KeyConfigError(f"no keys given; {_KEYS_HINT}")
        self._keys: dict[str, AESGCM] = {}
        for key_id, key in keys:
            _check_key_id(key_id)
            if key_id in self._keys:
                raise KeyConfigError(f"key id {key_id!r} is listed twice; {_KEYS_HINT}")
            if len(key) not in _KEY_SIZES:
                raise KeyConfigError(
                    f"key {key_id!r} is {len(key)} bytes; an AES key is 16, 24 or 32 bytes "
                    "(32 for AES-256): make one with `python -m examples.aes_gcm_codec KEYID`"
                )
            self._keys[key_id] = AESGCM(key)
        self.key_id = keys[0][0]
        self._content_type = f"{CONTENT_TYPE}; key-id={self.key_id}"
        self._aad = self._content_type.encode()
        self._json = JsonCodec()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AesGcmCodec:
        text = environ.get(KEYS_ENV, "").strip()
        if not text:
            raise KeyConfigError(f"{KEYS_ENV} is not set; {_KEYS_HINT}")
        return cls(parse_keys(text))

    @property
    def key_ids(self) -> list[str]:
        """The key ids it reads, the encrypting one first."""
        return list(self._keys)

    def encode(self, value: Any) -> Payload:
        plain = self._json.encode(value)
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._keys[self.key_id].encrypt(nonce, plain.data, self._aad)
        return Payload(self._content_type, nonce + sealed)

    def decode(self, payload: Payload) -> Any:
        kind, key_id = _parse_content_type(payload.content_type)
        if kind == _JSON:
            return self._json.decode(payload)  # written before encryption was turned on
        if kind != CONTENT_TYPE or key_id is None:
            raise InvalidPayload(
                f"payload has content type {payload.content_type!r}; this codec reads "
                f"{CONTENT_TYPE!r} (with a key-id) and {_JSON!r}: use the codec the writer used"
            )
        aead = self._keys.get(key_id)
        if aead is None:
            raise InvalidPayload(
                f"payload was encrypted with key id {key_id!r}, which {KEYS_ENV} does not "
                f"hold (it has {', '.join(self._keys)}); add {key_id}:BASE64KEY to "
                f"{KEYS_ENV} (after the encrypting key) to read it"
            )
        if len(payload.data) < NONCE_BYTES:
            raise InvalidPayload(f"payload under key id {key_id!r} is too short to hold a nonce")
        nonce, sealed = payload.data[:NONCE_BYTES], payload.data[NONCE_BYTES:]
        try:
            plain = aead.decrypt(nonce, sealed, payload.content_type.encode())
        except InvalidTag:
            raise InvalidPayload(
                f"payload does not authenticate under key id {key_id!r}: the key listed as "
                f"{key_id!r} in {KEYS_ENV} is not the one that wrote it, or the record was "
                "altered"
            ) from None
        return self._json.decode(Payload(_JSON, plain))


def parse_keys(text: str) -> list[tuple[str, bytes]]:
    """``k2:BASE64,k1:BASE64`` as (key id, key) pairs, in order."""
    keys = []
    for item in text.split(","):
        key_id, sep, encoded = item.strip().partition(":")
        if not sep or not key_id:
            raise KeyConfigError(f"{KEYS_ENV} entry {item.strip()!r} is not KEYID:BASE64KEY")
        try:
            key = base64.b64decode(encoded.strip(), validate=True)
        except binascii.Error:
            raise KeyConfigError(
                f"the key of {key_id!r} in {KEYS_ENV} is not base64; {_KEYS_HINT}"
            ) from None
        keys.append((key_id, key))
    return keys


def _check_key_id(key_id: str) -> None:
    if not key_id or any(c in _FORBIDDEN_IN_IDS for c in key_id):
        raise KeyConfigError(
            f"key id {key_id!r} must be non-empty, without spaces, quotes or any of , : ; ="
        )


def _parse_content_type(content_type: str) -> tuple[str, str | None]:
    """The media type and its ``key-id`` parameter, if any."""
    kind, *params = (part.strip() for part in content_type.split(";"))
    key_id = None
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "key-id":
            key_id = value.strip()
    return kind.lower(), key_id


def codec() -> AesGcmCodec:
    """The codec of ``--codec examples.aes_gcm_codec:codec``: keys from the environment,
    read when the command starts (so importing this module never fails for want of them)."""
    return AesGcmCodec.from_env()


def new_key(key_id: str) -> str:
    """A ``KEYID:BASE64KEY`` entry with a fresh random 256-bit key."""
    _check_key_id(key_id)
    return f"{key_id}:{base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()}"


if __name__ == "__main__":
    # `python -m examples.aes_gcm_codec k3` prints a new entry for STEPSTREAM_CODEC_KEYS;
    # `--bare` only the base64 key.
    arg = sys.argv[1] if len(sys.argv) > 1 else "k1"
    if arg == "--bare":
        print(base64.b64encode(AESGCM.generate_key(bit_length=256)).decode())
    else:
        print(new_key(arg))
