"""The SCRAM users a local Apache Kafka is formatted with: what the format tool can read,
and a clear refusal of what it cannot."""

from __future__ import annotations

import pytest

from stepstream.errors import BrokerError
from stepstream.ops.brokers.apache_config import ScramUser, format_arguments


def test_scram_users_become_format_arguments() -> None:
    users = (ScramUser("broker", "b-secret"), ScramUser("app", "a-secret", "SCRAM-SHA-256"))
    assert format_arguments("CLUSTER", users) == [
        *("format", "-t", "CLUSTER", "-c", "server.properties"),
        *("--add-scram", "SCRAM-SHA-512=[name=broker,password=b-secret]"),
        *("--add-scram", "SCRAM-SHA-256=[name=app,password=a-secret]"),
    ]


@pytest.mark.parametrize(
    ("user", "password", "mechanism", "says"),
    [
        ("app", "a,b", "SCRAM-SHA-512", "the password must be"),
        ("a]pp", "secret", "SCRAM-SHA-512", "the name must be"),
        ("app", "", "SCRAM-SHA-512", "the password must be non-empty"),
        ("app", "secret", "PLAIN", "is not one of SCRAM-SHA-256, SCRAM-SHA-512"),
    ],
)
def test_what_the_format_tool_cannot_read_is_refused(
    user: str, password: str, mechanism: str, says: str
) -> None:
    with pytest.raises(BrokerError, match=says):
        ScramUser(user, password, mechanism)
