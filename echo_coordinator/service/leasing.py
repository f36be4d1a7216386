"""Handing out leases: what a node that asks for work gets, training or evaluation.

Training seeds are the step loop's in sequential mode (`open_step`) and drawn fresh from
`first_seed` on in async mode as leases drain them. Every training lease is in the journal
before the node has it (`book_state`), so a restarted coordinator takes back what nodes hold.
"""

from __future__ import annotations

from collections.abc import Callable

from echo_coordinator.service.evaluating import EvalRounds
from echo_coordinator.service.settings import LeaseSettings
from protocols.errors import PeerRefused
from protocols.messages import LeaseRequest, RunManifest, TaskLease
from protocols.sampling import TRAINING_NOISE
from protocols.leases import LeaseBook
from protocols.sync import Mode, lease_version, told_version

MAX_LEASES_PER_KEY = 2  # outstanding at once: one in generation, one whose push is being retried
LAPSE_LONGEST = 3600.0  # the longest a key whose leases lapsed waits for its next one, seconds


def lapse_wait(lapses: int, first: float) -> float:
    """How long a key whose last `lapses` leases expired unanswered waits before its next lease:
    `first`, doubling with each lapse. Each lease it completes forgives one (`LeaseBook`)."""
    return min(first * 2.0 ** (lapses - 1), LAPSE_LONGEST) if lapses > 0 else 0.0


def training_seeds(request: LeaseRequest, settings: LeaseSettings, group_size: int, proven: bool) -> int:
    """Prompts in a training lease: the run's standard lease, or, for a key that has had a batch
    accepted lately (`proven`: keys are free, so a claim alone earns nothing), enough to fill the
    batch it says it decodes (`parallel` sequences, G a prompt), up to the settings' largest lease.
    Never more than the node asked for."""
    fill = -(-request.parallel // group_size)
    cap = min(max(settings.seeds_per_lease, fill), settings.largest_lease) if proven else settings.seeds_per_lease
    return max(1, min(request.max_seeds, cap))


class Leasing:
    """The training lease book and the run's phase (started, training, finished). No lock of its
    own: the service's lock guards it."""

    def __init__(self, manifest: RunManifest, render_prompt: Callable[[int], tuple[int, ...]],
                 settings: LeaseSettings, id_prefix: str):
        self.run_id, self.mode, self.group_size = manifest.run_id, Mode(manifest.mode), manifest.group_size
        self.staleness = manifest.staleness
        self.render_prompt, self.settings = render_prompt, settings
        self.book = LeaseBook(ttl=settings.lease_seconds, id_prefix=id_prefix, hold=settings.first_lease_seconds)
        self.next_seed = settings.first_seed  # async mode draws fresh seeds from here as leases drain them
        self.prompts: dict[int, tuple[int, ...]] = {}  # leasable or leased training seed -> its prompt
        self.started = False  # no work is handed out before the step loop starts (min_nodes reached)
        self.training = True  # false once the last step is taken: only evaluation work is left
        self.finished = False  # nothing left to hand out: nodes are told the run is over

    def book_state(self) -> dict:
        """The training leases, for the journal."""
        return {"leases": self.book.to_dict(), "next_seed": self.next_seed}

    def restore(self, values: dict) -> None:
        """The training leases the journal kept (`book_state`) at a restart."""
        book = LeaseBook.from_dict(values["leases"])
        book.ttl, book.hold = self.book.ttl, self.book.hold  # this start's settings, for the leases it issues
        self.book = book
        self.next_seed = int(values["next_seed"])
        for seed in book.pending_seeds + tuple(s for lease in book.outstanding for s in lease.seeds):
            self.prompts[seed] = self.render_prompt(seed)

    def told(self, version: int) -> int:
        """The version nodes are told is the newest when the trainer is at `version`."""
        return told_version(self.mode, version, self.settings.lag)

    def open_step(self, seeds: list[int], buffered: set[int]) -> None:
        """Sequential mode: lease these seeds, but those the book already knows or the buffer holds."""
        self.add_seeds([s for s in seeds if not self.book.knows(s) and s not in buffered])

    def add_seeds(self, seeds: list[int]) -> None:
        for seed in seeds:
            self.prompts[seed] = self.render_prompt(seed)
        self.book.add_seeds(seeds)

    def prompt(self, seed: int) -> tuple[int, ...]:
        """A leased seed's prompt (one answered already, for a lease a shadow beat: rendered again)."""
        return self.prompts[seed] if seed in self.prompts else self.render_prompt(seed)

    def answered(self, seed: int) -> None:
        self.prompts.pop(seed, None)  # never leased again

    def lease(self, request: LeaseRequest, now: float, version: int, buffered: int,
              rounds: EvalRounds, proven: bool = False) -> TaskLease | None:
        """The work for `request` at trainer `version` with `buffered` groups waiting to be trained
        on; None: none now. `proven`: the key has had a batch accepted lately.

        Peers that never deliver must not hold the run up (a step waits for every seed). A key
        whose lease lapsed (expired unanswered) waits before its next (`lapse_wait`) and is not
        proven until it has delivered as many leases as it let lapse. A key that is not proven gets
        leases of `first_lease_seconds`, and no seed that came back from another lease in that long: those
        go to keys that deliver first. A proven key's leases last `lease_seconds` and may fill its
        batch (`training_seeds`). Either holds at most `MAX_LEASES_PER_KEY`. A key that finds no
        seed it may take shadows an unproven key's lease (`_train_lease`)."""
        node_id = request.node_id
        books = [self.book] + rounds.books()
        for book in books:
            book.expire(now)  # an expired lease no longer counts against its key
        # Evaluation leases lapse too: a key that leaves them must wait as for training ones.
        counts = [book.lapses(node_id) for book in books]
        lapses, last = sum(n for n, _ in counts), max(at for _, at in counts)
        if now < last + lapse_wait(lapses, self.settings.first_lease_seconds):
            raise PeerRefused("lapsed", f"{lapses} leases of this key expired unanswered; the next one in "
                                        f"{last + lapse_wait(lapses, self.settings.first_lease_seconds) - now:.0f} s")
        proven = proven and lapses == 0
        held = sum(book.held_by(node_id) for book in books)
        if held >= MAX_LEASES_PER_KEY:
            raise PeerRefused("lease_limit", f"this key already holds {held} leases; push or let them expire")
        if not self.started:
            return None
        count = training_seeds(request, self.settings, self.group_size, proven)
        # Async nodes are never idle, so evaluation goes first; sequential nodes are idle
        # while the trainer steps, and evaluate then. Either way a node that holds an open
        # round's version answers it before training work moves it on: then it no longer can.
        holds_round = rounds.pending_at(request.version)
        if self.mode is Mode.ASYNC or (holds_round and request.version < version):
            return (rounds.lease(node_id, request, now, proven)
                    or self._train_lease(request, count, version, buffered, now, proven))
        return (self._train_lease(request, count, version, buffered, now, proven)
                or rounds.lease(node_id, request, now, proven))

    def _unproven_seeds(self) -> int:
        """Seeds out in unproven keys' leases: those shorter than the book's standard ones."""
        return sum(len(x.seeds) for x in self.book.outstanding if x.short(self.book.ttl))

    def _train_lease(self, request: LeaseRequest, count: int, version: int, buffered: int, now: float,
                     proven: bool) -> TaskLease | None:
        if not self.training:
            return None
        bound = lease_version(self.mode, self.staleness, version, request.version, request.update_failed,
                              self.settings.lag)
        if bound is None:
            return None  # the node is behind: it updates on hearing the latest version, and asks again
        max_ahead = self.settings.max_ahead
        if self.mode is Mode.ASYNC and max_ahead is not None and buffered >= max_ahead:
            return None
        # Every async lease draws fresh seeds: a flood of free keys would grow the book (and the
        # journal write every lease makes) without end. Unproven keys' leases count against
        # `max_ahead`; a proven straggler's do not, so it never stops the others.
        budget_left = proven or max_ahead is None or self._unproven_seeds() < max_ahead
        if self.mode is Mode.ASYNC and budget_left and self.book.leasable(now, proven) < count:
            fresh = list(range(self.next_seed, self.next_seed + count))
            self.next_seed += count
            self.add_seeds(fresh)
        ttl = None if proven else self.settings.first_lease_seconds
        lease = self.book.issue(request.node_id, count, bound, now, ttl, proven) if budget_left else None
        if lease is None:
            # Unproven keys hold every seed this key may take: it answers one of their leases
            # too, and whichever valid batch comes first counts (`LeaseBook.shadow`; the other,
            # if valid, still proves its key: `Pushes`).
            lease = self.book.shadow(request.node_id, count, bound, now, ttl or self.settings.lease_seconds)
        if lease is None:
            return None
        return TaskLease(
            lease_id=lease.lease_id, run_id=self.run_id, node_id=lease.node_id, seeds=lease.seeds,
            prompts=tuple(self.prompts[s] for s in lease.seeds), version=lease.version, expires_at=lease.expires_at,
            noise=TRAINING_NOISE,
        )
