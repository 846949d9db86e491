"""E2B's envd protocol: its ``.proto`` files (E2B's ``spec/envd``, Apache-2.0, see
``LICENSE`` beside them) and the code generated from them by ``scripts/e2b-protos.sh``, with
the generators E2B's SDK uses (``protoc-gen-py`` for the messages, ``protoc-gen-connectrpc``
for the services). Do not edit the ``*_pb.py`` and ``*_connect.py`` files: regenerate them."""
