"""What both ends of every rlfabric gRPC connection agree on: the message size limit and keepalive timing.

`server.py` builds its options from these and `client.py` its channels' options, so the two sides cannot drift.
"""

from __future__ import annotations

# One weight bucket (services/common/transports/grpc_stream.py) must fit in one message.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# How fast a dead peer is noticed on an open call: a ping after KEEPALIVE_TIME_MS of silence, the connection
# dropped when no answer comes within KEEPALIVE_TIMEOUT_MS. A SIGKILLed peer on the same host fails the call at
# once (the kernel resets the connection); a hung or partitioned one within about 15 s. Servers ping silent
# clients at the same pace, so the calls of a dead caller end as fast.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
