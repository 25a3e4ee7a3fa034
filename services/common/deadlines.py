"""The fixed deadlines of rlfabric's rpcs, in seconds: one table, each value with the reason it has.

A coordinator call that does a phase's work (a Generate stream, an Update, a weight push and the parameter
listing that plans it) runs under the run's `rlfabric.rpc_deadline_s` instead (services/coordinator/settings.py),
because its length grows with the model and the batch. The calls here do not grow so, or are longer than any
phase: a deadline of their own names a hung peer soon without failing a slow but healthy one.

Healthy peers answer every unary call here within milliseconds; the margins are for a loaded host (a 2-core
host running vLLM and Megatron beside the caller) and gRPC's transparent retries of UNAVAILABLE (four attempts,
services/common/client.py).
"""

from __future__ import annotations

# A small unary call a person or a launcher waits on (RegisterVerifier, ListVerifiers, ListTools from a CLI,
# GetRun) and the default of the weight transports' streams (services/common/transports).
DEFAULT_DEADLINE_S = 30.0

# Info (no parameters) of a trainer or rollout replica when a run or an evaluation starts: answered from memory,
# but the services have only just said SERVING and the host is still busy with the others' start (CUDA graphs,
# Megatron's set-up), so a minute.
INFO_DEADLINE_S = 60.0

# ListTools of a tool server the coordinator just discovered: asked while routing the rollout's tool calls, which
# wait for it, so short; a server that misses it is asked again at the next refresh.
LIST_TOOLS_DEADLINE_S = 10.0

# Info of a quarantined rollout replica before each weight push (services/coordinator/replicas.py): most such
# replicas are dead, and the push waits for every probe.
REJOIN_PROBE_DEADLINE_S = 2.0

# Info of each process for the weights column of `rlfabric system ps`: a person waits for the table, and a
# process that cannot answer in this long is shown as not saying.
PS_PROBE_DEADLINE_S = 5.0

# StartRun: the coordinator reads the config, loads the tokenizer and checks the data before it answers
# (services/coordinator/app.py); a tokenizer on a network file system can take minutes.
START_RUN_DEADLINE_S = 600.0

# StopRun after Ctrl-C: the coordinator waits as long (the call's own time remaining) for the current phase to
# end, and an Update or a checkpoint can take minutes (services/coordinator/follow.py).
STOP_RUN_DEADLINE_S = 300.0

# SaveCheckpoint: every rank writes its model and optimizer state, bounded by the disk, not by a phase; a large
# model's state is hundreds of GB.
CHECKPOINT_DEADLINE_S = 3600.0
