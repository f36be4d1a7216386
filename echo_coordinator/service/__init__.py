"""What the coordinator answers to nodes: leases and rollout pushes (updates are served by its relay).

Transport-free: every handler takes the request and returns a message, raising a `ProtocolError`
subclass for anything it refuses (the transport turns that into an ErrorReply and the ledger
counts it against the key that signed the request; an unsigned or forged one touches no row).
Nothing accepted is ever lost: a batch's groups are in the journal (`journal.py`) before its
push is acknowledged, and every training lease before it is handed out, so a restarted
coordinator goes on with both.

The service's state is changed only under its one lock, by its own methods: the parts below
hold no lock; `RunService` takes it around every call into them, and `pushes` takes it itself,
letting go of it while a batch is judged.

- `run_service`: RunService, the object the coordinator holds: the lock, the parts, every call.
- `settings`: what a service is built from: the work (task, prompts, scoring), lease settings.
- `registry`: what is known per node key: names, last requests, backends, hardware, held
  versions, the libp2p peers keys spoke from, who has heard the run is over, the lease rate limit.
- `leasing`: the training lease book, the run's phase, and what a node that asks is given.
- `evaluating`: the open evaluation rounds: their lease books, answers and records.
- `buffer`: the rollout gate and the replay buffer: what a step trains on (`StepBatch`).
- `judging`: pure decisions of a push: sample shapes, the versions a lease admits, GRPO groups.
- `pushes`: the push path: look up under the lock, judge outside it, commit under it.
- `policing`: rate limits, spot checks, bans, the allow-list, trusted relays (`Policing`).
"""

from echo_coordinator.service.buffer import StepBatch
from echo_coordinator.service.judging import Refused
from echo_coordinator.service.policing import Policing
from echo_coordinator.service.run_service import RunService
from echo_coordinator.service.settings import LeaseSettings, Work

__all__ = ["LeaseSettings", "Policing", "Refused", "RunService", "StepBatch", "Work"]
