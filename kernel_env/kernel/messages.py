"""Jupyter messages as the host reads them from a local kernel.

:class:`HostSession` is jupyter_client's ``Session`` (signing, replay protection, packing),
except that a message it reads keeps its header dates as the strings they came as. jupyter_client
parses them into datetimes (``extract_dates``, two a message with dateutil), which nothing here
reads: reading a message takes 19 us instead of 56 us.
"""

from __future__ import annotations

from hmac import compare_digest
from typing import Any

from jupyter_client.adapter import adapt
from jupyter_client.session import Session

__all__ = ["HostSession"]

_MIN_PARTS = 5  # signature, header, parent header, metadata, content (then buffers)


class HostSession(Session):
    """A ``Session`` whose :meth:`deserialize` leaves header dates unparsed."""

    def deserialize(
        self, msg_list: list[Any], content: bool = True, copy: bool = True
    ) -> dict[str, Any]:
        if not (content and copy):  # the host reads whole messages, copied: jupyter_client's
            return super().deserialize(msg_list, content=content, copy=copy)
        if len(msg_list) < _MIN_PARTS:
            raise TypeError(f"malformed message, must have at least {_MIN_PARTS} elements")
        if self.auth is not None:  # as jupyter_client checks it
            signature = msg_list[0]
            if not signature:
                raise ValueError("Unsigned Message")
            if signature in self.digest_history:
                raise ValueError(f"Duplicate Signature: {signature!r}")
            self._add_digest(signature)
            if not compare_digest(signature, self.sign(msg_list[1:_MIN_PARTS])):
                raise ValueError(f"Invalid Signature: {signature!r}")
        header = self.unpack(msg_list[1])
        message = {
            "header": header,
            "msg_id": header["msg_id"],
            "msg_type": header["msg_type"],
            "parent_header": self.unpack(msg_list[2]),
            "metadata": self.unpack(msg_list[3]),
            "content": self.unpack(msg_list[4]),
            "buffers": [memoryview(b) for b in msg_list[_MIN_PARTS:]],
        }
        return adapt(message)
