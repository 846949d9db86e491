"""The host's reading of Jupyter messages (kernel.messages): jupyter_client's, signature checks
included, with header dates left as strings."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from kernel_env.kernel.messages import HostSession

KEY = b"0123456789abcdef"


def _wire(session: Session, msg_type: str = "stream", **content: object) -> list[bytes]:
    """A message as a kernel sends it: its frames, after the identities."""
    parent = session.msg("execute_request", {"code": "1"})
    msg = session.msg(msg_type, content or {"name": "stdout", "text": "hi"}, parent=parent)
    return session.serialize(msg)[1:]  # without the <IDS|MSG> delimiter


def test_a_message_reads_as_jupyter_client_reads_it_with_dates_as_strings() -> None:
    sender = Session(key=KEY)
    frames = _wire(sender)
    ours = HostSession(key=KEY).deserialize(list(frames))
    theirs = Session(key=KEY).deserialize(list(frames))
    for part in ("header", "parent_header"):
        assert isinstance(ours[part]["date"], str)
        assert ours[part]["date"] == theirs[part]["date"].isoformat().replace("+00:00", "Z")
        assert {k: v for k, v in ours[part].items() if k != "date"} == {
            k: v for k, v in theirs[part].items() if k != "date"
        }
    for part in ("msg_id", "msg_type", "metadata", "content", "buffers"):
        assert ours[part] == theirs[part]


@pytest.mark.parametrize("attack", ["forged", "replayed", "unsigned", "truncated"])
def test_a_message_that_fails_its_checks_is_refused(attack: str) -> None:
    reader = HostSession(key=KEY)
    frames = _wire(Session(key=KEY))
    if attack == "forged":
        frames = _wire(Session(key=b"another key....."))
    elif attack == "replayed":
        reader.deserialize(list(frames))
    elif attack == "unsigned":
        frames = [b"", *frames[1:]]
    elif attack == "truncated":
        frames = frames[:3]
    with pytest.raises((ValueError, TypeError)):
        reader.deserialize(list(frames))
